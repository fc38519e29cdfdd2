"""The small copies between the host and the logits' device around a step's sampling.

A step's logits never leave their device: the sampler and the prompt scorer reduce them there
and pack what the requests asked for (token ids, log-probabilities) into one tensor, which
crosses to the host in one copy (`HostCopy`). On CUDA that copy goes into pinned memory without
blocking the stream, and the host waits on an event recorded after it: the copy is the stream's
last work, so once it is done everything the step queued (a replayed decode graph included) is
done, and the graph's staging buffers may be written for the next step. On CPU it is a plain
copy (the packed tensor itself).

The other direction carries what the host knows about a step's rows (row indices, each row's
temperature, top-k, penalties, token histories, grammar bitmasks): `to_device` makes each such
tensor in pinned memory and copies it without blocking, so no host list becomes a stream sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Number = int | float | bool


def to_host(packed: torch.Tensor) -> torch.Tensor:
    """`packed` on the host: one copy (pinned, non-blocking, then an event waited on, on CUDA)."""
    if packed.device.type != "cuda":
        return packed.cpu()
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.current_stream(packed.device).record_event()  # after the copy
    done.synchronize()
    return host


class HostCopy:
    """`to_host`, counting what it moves: a step's device->host bytes are the growth of `bytes`
    over the step (the sampler's copy, and the prompt scores' in a step that has them)."""

    def __init__(self) -> None:
        self.bytes = 0  # moved device->host so far (on CPU: what would have moved)
        self.copies = 0

    def __call__(self, packed: torch.Tensor) -> torch.Tensor:
        self.bytes += packed.numel() * packed.element_size()
        self.copies += 1
        return to_host(packed)


def to_device(
    values: Sequence[Number] | Sequence[Sequence[Number]] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Host values (or a host tensor) as a `dtype` tensor on `device`, without a stream sync on
    CUDA: a pinned source copied non-blocking (the caching host allocator keeps the source's
    memory until the copy is done)."""
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
        if device.type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)
        return host.to(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
