"""Devices as the engine keeps them: indexed, as its tensors report them.

`torch.device("cuda")` is not equal to the `torch.device("cuda", 0)` that a tensor on it reports,
so a pool, table or cache keyed by the unindexed one never matches the tensors it serves (found
on the first GPU run: the LoRA layers refused their pool, and slot tables were rebuilt on every
call). Every device the engine keeps goes through `torch_device` once, where it is built.
"""

from __future__ import annotations

import torch


def torch_device(device: torch.device | str) -> torch.device:
    """`device` with its index: the current CUDA device where a CUDA device names none
    (ValueError when torch sees no CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        if not torch.cuda.is_available():
            raise ValueError("device is 'cuda' but torch sees no CUDA device; use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return device


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` and `b` are one device, an unindexed CUDA device being the current one."""
    return a == b or (a.type == b.type and torch_device(a) == torch_device(b))
