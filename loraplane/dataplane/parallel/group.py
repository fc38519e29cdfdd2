"""Rank 0's side of a tensor-parallel group: start the workers, send each step, stop them.

The workers are spawned processes (`worker.main`), one per extra device. Each step rank 0
broadcasts one `StepMessage` (the plan, and the adapter slots that changed), then, when an
adapter took a slot, sends each worker the bytes of its own part of it (rank 0 read and
validated the adapter once and keeps every rank's part with its host copy, parallel/ship.py:
no worker reads adapter files); then every rank runs the plan. A worker that died, or failed,
makes the next collective fail on rank 0 with `WorkerLost` naming the worker's error, and the
engine stops (its replica not ready).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.util as mp_util
import queue
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.parallel import worker
from loraplane.dataplane.parallel.comm import Collectives, join, leave
from loraplane.dataplane.parallel.errors import WorkerLost
from loraplane.dataplane.parallel.shard import TPShard

if TYPE_CHECKING:
    from loraplane.dataplane.model_step import StepPlan
    from loraplane.dataplane.parallel.ship import PackedPart

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0  # the group's collectives time out after this (a hung rank)
STOP_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class SlotLoad:
    """Put version `key`'s part into `slot`: its `layout` (the same on every rank), and its
    `nbytes` of tensors, which follow the message (`WorkerGroup.send`)."""

    slot: int
    key: str
    layout: PackedPart
    nbytes: int
    first: int | None = None  # adapters inside the KV cache: the run's first block (rank 0's)


@dataclass(frozen=True, slots=True)
class Allocate:
    """Allocate the KV cache: `num_blocks` blocks of `block_size` tokens (rank 0's numbers)."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One step for the workers: free `frees`, fill `loads` (with the bytes rank 0 sends each
    worker after this message, in `loads` order), sum the DoRA norms of `norms`, then run
    `plan`."""

    plan: StepPlan
    frees: list[int]
    loads: list[SlotLoad]
    # slots whose DoRA g of split rows every rank sums now (LoRAPool.sync_norms)
    norms: list[int] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerGroup:
    """The worker processes of one engine and rank 0's collectives with them."""

    def __init__(
        self, comm: Collectives, procs: Sequence[multiprocessing.process.BaseProcess], errors: Any
    ) -> None:
        self.comm = comm
        self._procs = procs
        self._errors = errors
        self._closed = False
        # at exit, or when the group is collected without `close`: terminate the workers
        # (before multiprocessing joins its children)
        mp_util.Finalize(self, _terminate, (procs,), exitpriority=10)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> WorkerGroup:
        """Spawn ranks 1..N-1 and join the group as rank 0 (blocks until all joined)."""
        size = config.tensor_parallel_size
        address = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        errors = context.Queue()
        procs = []
        for rank in range(1, size):
            proc = context.Process(
                target=worker.main, args=(config, rank, address, errors),
                name=f"loraplane-tp{rank}", daemon=True,
            )  # fmt: skip
            proc.start()
            procs.append(proc)
        try:
            comm = join(TPShard(0, size), address, device, JOIN_TIMEOUT_S)
        except Exception as e:
            _stop(procs)
            raise WorkerLost(f"the tensor-parallel workers did not start: {e}") from e
        log.info("tensor parallelism: %d ranks over %s", size, comm_backend(device))
        return cls(comm, procs, errors)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Have the workers allocate the same KV cache as rank 0."""
        self._send(Allocate(num_blocks, block_size))

    def send(self, message: StepMessage, buffers: Sequence[Sequence[np.ndarray]] = ()) -> None:
        """Broadcast one step, then send each worker its parts' bytes of the adapters
        `message` puts in slots: `buffers[r - 1]` to rank r, one per load in `message.loads`
        order (WorkerLost when a worker is gone)."""
        if message.loads and len(buffers) != len(self._procs):
            raise ValueError(f"{len(buffers)} workers' parts for {len(self._procs)} workers")
        self._send(message)
        if message.loads:
            self._guarded(lambda: self.comm.send_bytes(buffers))

    def _send(self, message: Any) -> None:
        self._guarded(lambda: self.comm.broadcast(message))

    def _guarded(self, collective: Callable[[], object]) -> None:
        """Run one of rank 0's control collectives; WorkerLost naming a worker's error."""
        dead = [p for p in self._procs if not p.is_alive()]
        if dead:
            raise WorkerLost(self._why(f"tensor-parallel worker {dead[0].name} exited"))
        try:
            collective()
        except WorkerLost as e:
            raise WorkerLost(self._why(str(e))) from e

    def _why(self, what: str) -> str:
        """`what`, with the first error a worker reported (waiting a moment for it)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                rank, error = self._errors.get(timeout=0.1)
            except queue.Empty:
                continue
            return f"{what}: rank {rank} failed: {error}"
        return what

    def close(self) -> None:
        """Tell the workers to stop, wait for them (killing any that does not), leave."""
        if self._closed:
            return
        self._closed = True
        if all(p.is_alive() for p in self._procs):
            with contextlib.suppress(WorkerLost):
                self.comm.broadcast(None)
        _stop(self._procs)
        leave()


def comm_backend(device: torch.device) -> str:
    return "NCCL" if device.type == "cuda" else "gloo"


def _terminate(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    _stop(procs)


def _stop(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
