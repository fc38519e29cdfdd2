"""The CPUs this process may use, and the torch threads the engine gives its CPU work.

torch sizes its intra-op thread team from the cores the process may run on (its affinity mask),
not from a container's CPU limit: a pod limited to 2 CPUs on a 64-core node gets a team of 32
or 64 threads. Each parallel region then waits at its barrier for threads that the kernel's
CFS quota has throttled until the next period (100 ms by default), so a decode step of a few
hundred parallel regions takes seconds instead of tens of milliseconds (measured here with
other processes on the 2 cores: 3-5 s against 0.07 s). The same happens wherever more threads
than CPUs take part in one region.

`usable_cpus()` is the smaller of the affinity mask's count and the cgroup's CPU limit (cgroup
v2 `cpu.max`, else v1 `cpu.cfs_quota_us / cpu.cfs_period_us`; the tightest along the
process's cgroup path), rounded down, at least 1: a fractional limit (1.5) rounds down so
the team never outgrows its share (Go's automaxprocs rounds the same way).
`LORAPLANE_CPU_THREADS` overrides the engine's team size (a positive integer).

    torch.set_num_threads(engine_threads(ranks=2))  # each of two TP ranks on the CPU
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "LORAPLANE_CPU_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (the machine's count off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _v2_limit(folder: Path) -> float | None:
    """`cpu.max` of one cgroup v2 folder: "max 100000" (no limit) or "200000 100000" (2 CPUs)."""
    text = _read(folder / "cpu.max")
    if text is None:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_limit(folder: Path) -> float | None:
    """cgroup v1's quota over period in one cpu controller folder (quota -1: no limit)."""
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _own_paths(proc_cgroup: Path) -> dict[str, str]:
    """This process's cgroup path per controller list ("" for v2's unified line)."""
    paths: dict[str, str] = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3:
            paths[fields[1]] = fields[2]
    return paths


def _folders(mount: Path, path: str) -> list[Path]:
    """`mount/path` and each folder above it up to `mount` (a limit anywhere up the tree
    binds); only `mount` itself when the path is not visible (a container's own namespace
    usually shows its cgroup at the mount point)."""
    folders = [mount]
    inner = mount / path.lstrip("/")
    if path.strip("/") and inner.is_dir():
        folders = [inner, *inner.parents]
        folders = folders[: folders.index(mount) + 1] if mount in folders else [inner, mount]
    return folders


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU limit (in CPUs) of this process's cgroup, the tightest along its path; None when
    there is none or it cannot be read."""
    own = _own_paths(proc_cgroup)
    limits: list[float] = []
    if (root / "cgroup.controllers").exists():  # v2, one unified hierarchy
        for folder in _folders(root, own.get("", "/")):
            limit = _v2_limit(folder)
            if limit is not None:
                limits.append(limit)
    else:  # v1: the cpu controller's own mount
        for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            mount = root / name
            if mount.is_dir():
                path = next((p for c, p in own.items() if "cpu" in c.split(",")), "/")
                for folder in _folders(mount, path):
                    limit = _v1_limit(folder)
                    if limit is not None:
                        limits.append(limit)
                break
    return min(limits) if limits else None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The CPUs this process may keep busy: its affinity mask's count, capped by its cgroup's
    CPU limit rounded down; at least 1."""
    cpus = affinity_cpus()
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        cpus = min(cpus, math.floor(limit))
    return max(1, cpus)


def engine_threads(ranks: int = 1, cpus: int | None = None) -> int:
    """torch's intra-op threads for each of `ranks` engine processes sharing this process's
    CPUs (`LORAPLANE_CPU_THREADS` when set): the usable CPUs shared out, at least 1."""
    override = os.environ.get(ENV)
    if override is not None:
        try:
            threads = int(override)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"{ENV} must be a positive integer, got {override!r}")
        return threads
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, cpus // max(1, ranks))


def size_torch_threads(ranks: int = 1) -> int:
    """Cap torch's intra-op team at `engine_threads(ranks)` (exactly that when
    `LORAPLANE_CPU_THREADS` is set) and return its size, logged when it changes. A smaller team
    set earlier stays (the planner's validation runs its replica on one thread)."""
    import torch  # here, so that the server's settings and tests read this module without torch

    before = torch.get_num_threads()
    threads = engine_threads(ranks)
    if ENV not in os.environ:
        threads = min(threads, before)
    if threads != before:
        log.info(
            "torch threads %d (was %d): %d usable CPUs (affinity %d, cgroup limit %s), %d rank(s)",
            threads, before, usable_cpus(), affinity_cpus(), cgroup_cpu_limit(), ranks,
        )  # fmt: skip
        torch.set_num_threads(threads)
    return threads


__all__ = [
    "ENV",
    "affinity_cpus",
    "cgroup_cpu_limit",
    "engine_threads",
    "size_torch_threads",
    "usable_cpus",
]
