"""A tensor-parallel worker: rank 1..N-1 of an engine's group, in a process of its own.

It joins the group, loads its shard of the model, allocates the KV cache rank 0 sizes, then
runs each step rank 0 broadcasts until it is told to stop (a None message), or until a
collective fails because rank 0 is gone. An adapter put in a slot arrives as this rank's part,
read and validated by rank 0 (never from its files). An error is reported on `errors` (rank 0
names it) before the process exits.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch

from loraplane.dataplane import kv_quant
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.cpus import size_torch_threads
from loraplane.dataplane.devices import torch_device
from loraplane.dataplane.host_copy import HostCopy
from loraplane.dataplane.lora.arena import KVArena
from loraplane.dataplane.model_step import build_model, run_plan
from loraplane.dataplane.parallel.comm import Collectives, join, leave
from loraplane.dataplane.parallel.errors import WorkerLost
from loraplane.dataplane.parallel.shard import TPShard
from loraplane.dataplane.parallel.ship import unpack, with_buffer

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0


def device_of(config: EngineConfig, rank: int) -> torch.device:
    """Rank `rank`'s device: CUDA device `rank`, or the CPU."""
    base = torch_device(config.device)
    return torch.device("cuda", rank) if base.type == "cuda" else base


def main(config: EngineConfig, rank: int, address: str, errors: Any) -> None:
    """The worker process (multiprocessing's target)."""
    # the engine's process stops it (a None step, a SIGTERM at its exit, or its collectives
    # failing), not a terminal's Ctrl-C, which reaches the whole process group
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    shard = TPShard(rank, config.tensor_parallel_size)
    device = device_of(config, rank)
    if device.type == "cpu":
        size_torch_threads(shard.size)  # the usable CPUs shared out
    else:  # Triton launches on the current device, and NCCL binds to it
        torch.cuda.set_device(device)
    try:
        comm = join(shard, address, device, JOIN_TIMEOUT_S)
    except Exception as e:
        errors.put((rank, f"joining the group failed: {type(e).__name__}: {e}"))
        return
    try:
        _serve(config, comm, device)
    except WorkerLost:
        pass  # rank 0 is gone (or stopped answering): nothing to report to
    except BaseException as e:
        errors.put((rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        leave()


def _serve(config: EngineConfig, comm: Collectives, device: torch.device) -> None:
    with torch.inference_mode():
        built = build_model(config, device, comm.shard, comm)
        model, pool = built.model, built.pool
        host_copy = HostCopy()
        setup = comm.broadcast(None)
        model.allocate_kv_cache(setup.num_blocks, setup.block_size)
        if config.kv_lora_shared:  # adapters in the runs of KV blocks rank 0 reserves
            assert model.kv_cache is not None
            pool.attach_arena(KVArena(kv_quant.storage_view(model.kv_cache, pool.dtype), None))
        while True:
            message = comm.broadcast(None)
            if message is None:
                return
            for slot in message.frees:
                pool.free(slot)
            if message.loads:  # this rank's parts' bytes, one per load, follow the message
                buffers = comm.receive_bytes([load.nbytes for load in message.loads])
                for load, buffer in zip(message.loads, buffers, strict=True):
                    pool.free(load.slot)
                    part = unpack(with_buffer(load.layout, buffer))
                    pool.load(load.slot, pool.host_form(part), at=load.first)
            pool.sync_norms(message.norms, comm.all_reduce)
            run_plan(model, message.plan, setup.block_size, host_copy)
