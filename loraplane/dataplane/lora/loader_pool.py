"""The loader threads' pool, at a low CPU priority (`LORAPLANE_LOADER_NICE`).

Loader threads run at nice 19 by default: they fill the CPU time the step leaves idle instead
of taking cores from its compute threads (on a CPU device an OpenMP barrier waits for a
descheduled thread), while a GPU step leaves the CPU to them anyway. 0 leaves them at the
engine's priority.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

NICE_ENV = "LORAPLANE_LOADER_NICE"


def loader_nice() -> int:
    """The loader threads' nice value, from LORAPLANE_LOADER_NICE (default 19; 0 leaves them
    at the engine's priority). ValueError naming the variable when it is not 0..19."""
    text = os.environ.get(NICE_ENV, "19").strip()
    if not text.isdigit() or not 0 <= int(text) <= 19:
        raise ValueError(f"{NICE_ENV} must be an integer in 0..19, got {text!r}")
    return int(text)


def _lower_priority(nice: int) -> None:
    """Set the calling thread's nice value (Linux only; elsewhere nothing)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def loader_pool(max_workers: int) -> ThreadPoolExecutor:
    """A pool of `max_workers` loader threads ("lora-load-N") at `loader_nice()`."""
    nice = loader_nice()
    return ThreadPoolExecutor(
        max_workers=max_workers,
        thread_name_prefix="lora-load",
        initializer=functools.partial(_lower_priority, nice) if nice else None,
    )
