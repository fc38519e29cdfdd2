"""Choosing a kernel implementation from an environment variable (`LORAPLANE_SGMV`,
`LORAPLANE_ATTENTION`), read where a step is prepared, so tests can set it between steps:
`auto` is Triton for CUDA tensors when Triton is installed, the caller's CPU choice (else
torch) for the rest; any other listed value is taken as is.

The LoRA layers read `LORAPLANE_SGMV` once per step: `read_choice` when the step's `LoRABatch`
is built, `resolve` per layer (attribute checks, no environment read); the attention layers
read `LORAPLANE_ATTENTION` the same way, when the step's `AttentionMetadata` is built."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence

import torch


@functools.cache
def has_triton() -> bool:
    """True when Triton can be imported (it is imported only when its path is taken)."""
    return importlib.util.find_spec("triton") is not None


SGMV_ENV = "LORAPLANE_SGMV"
SGMV_BACKENDS = ("auto", "native", "torch", "triton", "triton-fused")
ATTENTION_ENV = "LORAPLANE_ATTENTION"
ATTENTION_BACKENDS = ("auto", "native", "torch", "triton")


def read_choice(env: str, backends: Sequence[str]) -> str:
    """The value of `env` (one of `backends`, `auto` when unset); ValueError naming `env`
    for any other."""
    choice = os.environ.get(env, "auto").strip().lower() or "auto"
    if choice not in backends:
        raise ValueError(f"{env} must be one of {', '.join(backends)}, got {choice!r}")
    return choice


def resolve(
    choice: str, x: torch.Tensor, cpu_auto: Callable[[torch.Tensor], str] | None = None
) -> str:
    """`choice` (from `read_choice`) for tensors like `x`: `auto` on a CUDA tensor is Triton
    (torch without Triton), on any other `cpu_auto(x)` when given, else torch."""
    if choice != "auto":
        return choice
    if x.is_cuda:
        return "triton" if has_triton() else "torch"
    return cpu_auto(x) if cpu_auto is not None else "torch"


def choose(
    env: str,
    backends: Sequence[str],
    x: torch.Tensor,
    cpu_auto: Callable[[torch.Tensor], str] | None = None,
) -> str:
    """The implementation `env` asks for (one of `backends`) for tensors like `x`; `auto` on a
    tensor that is not CUDA is `cpu_auto(x)` when given, else torch."""
    return resolve(read_choice(env, backends), x, cpu_auto)


class Switch:
    """A CPU fast path that `env` turns off: `auto` (on where it applies, the default) or
    `torch` (off); read once, at import, and settable for the rest of the process (tests and
    benchmarks compare the two)."""

    MODES = ("auto", "torch")

    def __init__(self, env: str) -> None:
        self.env = env
        value = os.environ.get(env, "auto")
        if value not in self.MODES:
            raise ValueError(f"{env} must be one of {', '.join(self.MODES)}, got {value!r}")
        self.on = value == "auto"

    def set(self, mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {', '.join(self.MODES)}, got {mode!r}")
        self.on = mode == "auto"

    def mode(self) -> str:
        return "auto" if self.on else "torch"
