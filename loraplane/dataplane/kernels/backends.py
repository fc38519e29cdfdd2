"""Choosing a kernel implementation from an environment variable (`LORAPLANE_SGMV`,
`LORAPLANE_ATTENTION`), read at each call so tests can set it: `auto` is Triton for CUDA
tensors when Triton is installed, the caller's CPU choice (else torch) for the rest; any other
listed value is taken as is."""

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


def choose(
    env: str,
    backends: Sequence[str],
    x: torch.Tensor,
    cpu_auto: Callable[[torch.Tensor], str] | None = None,
) -> str:
    """The implementation `env` asks for (one of `backends`) for tensors like `x`; `auto` on a
    tensor that is not CUDA is `cpu_auto(x)` when given, else torch."""
    choice = os.environ.get(env, "auto").strip().lower() or "auto"
    if choice not in backends:
        raise ValueError(f"{env} must be one of {', '.join(backends)}, got {choice!r}")
    if choice == "auto":
        if x.is_cuda:
            return "triton" if has_triton() else "torch"
        return cpu_auto(x) if cpu_auto is not None else "torch"
    return choice
