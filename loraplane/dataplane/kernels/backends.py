"""Choosing a kernel implementation from an environment variable (`LORAPLANE_SGMV`,
`LORAPLANE_ATTENTION`), read at each call so tests can set it: `auto` is Triton for CUDA
tensors when Triton is installed and torch otherwise; any other listed value is taken as is."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence

import torch


@functools.cache
def has_triton() -> bool:
    """True when Triton can be imported (it is imported only when its path is taken)."""
    return importlib.util.find_spec("triton") is not None


def choose(env: str, backends: Sequence[str], x: torch.Tensor) -> str:
    """The implementation `env` asks for (one of `backends`) for tensors like `x`."""
    choice = os.environ.get(env, "auto").strip().lower() or "auto"
    if choice not in backends:
        raise ValueError(f"{env} must be one of {', '.join(backends)}, got {choice!r}")
    if choice == "auto":
        return "triton" if x.is_cuda and has_triton() else "torch"
    return choice
