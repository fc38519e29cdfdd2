"""The collectives a tensor-parallel step runs, over torch.distributed.

Tensors go over the default group (NCCL on CUDA, gloo on CPU); rank 0's step messages, and the
adapter parts it ships each worker, go over a gloo group of their own (pickled objects, on the
host, whatever the device). Every collective has the
group's timeout: a rank that stops answering fails the others' step (never a hang forever).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from loraplane.dataplane.parallel.errors import WorkerLost
from loraplane.dataplane.parallel.shard import TPShard


@dataclass(slots=True)
class Collectives:
    """This process's place in a tensor-parallel group and the operations the model uses."""

    shard: TPShard
    control: Any  # the gloo group for step messages
    # wall time summed (what benchmarks/engine_cpu.py --tp splits a step into): in all-reduce
    # and all-gather, waits for the slowest rank included; in rank 0's step broadcasts
    comm_seconds: float = 0.0
    message_seconds: float = 0.0
    ship_seconds: float = 0.0  # rank 0's sends of adapter parts to the workers (placements)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place."""
        start = time.perf_counter()
        try:
            dist.all_reduce(x)
        except RuntimeError as e:
            raise WorkerLost(f"a tensor-parallel rank failed during all-reduce: {e}") from e
        self.comm_seconds += time.perf_counter() - start
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension (rank order)."""
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.shard.size)]
        try:
            dist.all_gather(parts, x.contiguous())
        except RuntimeError as e:
            raise WorkerLost(f"a tensor-parallel rank failed during all-gather: {e}") from e
        self.comm_seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1)

    def broadcast(self, message: Any) -> Any:
        """Rank 0's `message`, on every rank (the others pass None)."""
        box = [message]
        start = time.perf_counter()
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except RuntimeError as e:
            raise WorkerLost(f"a tensor-parallel rank failed to take a step: {e}") from e
        self.message_seconds += time.perf_counter() - start
        return box[0]

    def send_bytes(self, buffers: Sequence[Sequence[np.ndarray]]) -> None:
        """Rank 0: `buffers[r - 1]` to rank r, in order (uint8 arrays, raw: no pickling; each
        worker takes its own with `receive_bytes`)."""
        start = time.perf_counter()
        try:
            sent = [
                dist.isend(torch.from_numpy(buffer), rank, group=self.control)
                for rank, mine in enumerate(buffers, start=1)
                for buffer in mine
            ]
            for work in sent:
                if work is not None:  # None: a rank outside the group (never here)
                    work.wait()
        except RuntimeError as e:
            raise WorkerLost(f"a tensor-parallel rank failed to take its adapter parts: {e}") from e
        self.ship_seconds += time.perf_counter() - start

    def receive_bytes(self, sizes: Sequence[int]) -> list[np.ndarray]:
        """A worker: the uint8 arrays of `sizes` bytes rank 0 sends it (`send_bytes`)."""
        out = [np.empty(size, dtype=np.uint8) for size in sizes]
        try:
            for buffer in out:
                dist.recv(torch.from_numpy(buffer), 0, group=self.control)
        except RuntimeError as e:
            raise WorkerLost(f"rank 0 failed while sending adapter parts: {e}") from e
        return out


def backend_for(device: torch.device) -> str:
    """NCCL between CUDA devices, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def join(shard: TPShard, address: str, device: torch.device, timeout_s: float) -> Collectives:
    """Join the group at `address` (tcp://host:port) as `shard.rank`; blocks until every rank
    has joined (or `timeout_s` passes: RuntimeError)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(
        backend_for(device), init_method=address, rank=shard.rank, world_size=shard.size,
        timeout=timeout, **kwargs,
    )  # fmt: skip
    control = dist.new_group(backend="gloo", timeout=timeout)
    return Collectives(shard, control)


def leave() -> None:
    """Leave the group (nothing when this process is in none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
