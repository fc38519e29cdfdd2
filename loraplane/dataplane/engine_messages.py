"""What the engine's process and the server's say to each other over their pipe (the protocol in
engine_process.py's docstring): plain dataclasses that pickle, and errors made portable."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraplane.adapters.errors import AdapterRejected
from loraplane.dataplane.outputs import RequestOutput
from loraplane.dataplane.sequence import LoRARef

if TYPE_CHECKING:
    pass

EXIT_GRACE_S = 10.0  # the child's wait for its step to end once the server is gone


EXIT_GRACE_S = 10.0  # the child's wait for its step to end once the server is gone


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine loaded: what the server needs of it."""

    max_model_len: int
    vocab_size: int
    registered: list[LoRARef]
    loads: list[tuple[str, float]]


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine could not be built (the StartupError's message)."""

    message: str


@dataclass(frozen=True, slots=True)
class Step:
    """One step's outputs, every request's in one message (ids, no text), and the loop's
    health fields."""

    outputs: list[RequestOutput]
    errors: list[tuple[str, Any]]  # (request id, a portable error)
    loads: list[tuple[str, float]]  # adapter loads since the last message: (tier, seconds)
    progress_at: float
    failed_in_a_row: int
    failed_at: float


@dataclass(frozen=True, slots=True)
class Reply:
    """A command's result, or its portable error."""

    call: int
    ok: bool
    value: Any


@dataclass(frozen=True, slots=True)
class Died:
    """The engine loop ended on an exception (its type only: a message may name a request)."""

    reason: str


def portable(error: BaseException) -> Any:
    """`error` in a form that pickles and rebuilds (`rebuild`): itself when it round-trips,
    AdapterRejected as its code and message, anything else as a RuntimeError naming its type."""
    if isinstance(error, AdapterRejected):
        return ("AdapterRejected", error.code, error.message)
    try:
        copy = pickle.loads(pickle.dumps(error))  # noqa: S301 (our own bytes, just made)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return copy if type(copy) is type(error) else RuntimeError(str(error))


def rebuild(value: Any) -> BaseException:
    """The exception `portable` made of an error."""
    if isinstance(value, tuple) and value[0] == "AdapterRejected":
        return AdapterRejected(value[1], value[2])
    assert isinstance(value, BaseException)
    return value
