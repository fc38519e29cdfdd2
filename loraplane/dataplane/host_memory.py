"""Host memory a CPU engine may plan with (the adapter budget's fraction, the KV cache's share).

Free pages alone (`SC_AVPHYS_PAGES`, MemFree) are the wrong figure: on a machine that has read
or written files, most of the memory nobody uses holds page cache, which the kernel gives back
on demand. A data plane started after ingesting 2,000 adapters saw 1 GiB free of 16 GiB
available, and sized its adapter budget at a tenth of that. What the kernel can give without
swapping is MemAvailable (/proc/meminfo). In a container the cgroup's limit bounds it too: the
limit less the working set (usage less inactive file pages, as the kubelet counts it).
Elsewhere (no /proc) the free pages are the answer.
"""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as a huge number (a page-rounded LONG_MAX)
_UNLIMITED = 1 << 60


def available_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int:
    """Bytes the process can allocate now without swapping: MemAvailable, or the free pages
    where the kernel does not say; within the cgroup's room where it has a limit."""
    available = _meminfo_kib(meminfo, "MemAvailable")
    if available is None:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    else:
        free = available * 1024
    room = _cgroup_room(cgroup)
    return free if room is None else max(0, min(free, room))


def total_bytes(cgroup: Path = CGROUP) -> int:
    """The machine's memory, or the cgroup's limit where that is lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    usage = _cgroup_usage(cgroup)
    return physical if usage is None else min(physical, usage[0])  # (limit, working set)


def _meminfo_kib(meminfo: Path, field: str) -> int | None:
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            value = rest.split()
            return int(value[0]) if value and value[0].isdigit() else None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, field: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == field and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_usage(cgroup: Path) -> tuple[int, int] | None:
    """(limit, working set) of the cgroup (v2, else v1), or None without a limit."""
    v2 = cgroup / "memory.max"
    if v2.is_file():
        limit = _read_int(v2)  # "max": no limit
        usage = _read_int(cgroup / "memory.current")
        inactive = _stat(cgroup / "memory.stat", "inactive_file")
    else:
        v1 = cgroup / "memory"
        limit = _read_int(v1 / "memory.limit_in_bytes")
        usage = _read_int(v1 / "memory.usage_in_bytes")
        inactive = _stat(v1 / "memory.stat", "total_inactive_file")
    if limit is None or limit >= _UNLIMITED:
        return None
    return limit, max(0, (usage or 0) - inactive)


def _cgroup_room(cgroup: Path) -> int | None:
    usage = _cgroup_usage(cgroup)
    return None if usage is None else usage[0] - usage[1]
