"""Host memory for CPU budgets: MemAvailable (page cache counts as available), bounded by a
cgroup's limit less its working set; free pages where the kernel says nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraplane.dataplane import host_memory

GIB = 1 << 30


def _meminfo(tmp_path: Path, free_kib: int, available_kib: int | None) -> Path:
    lines = ["MemTotal:       24000000 kB", f"MemFree:        {free_kib} kB"]
    if available_kib is not None:
        lines.append(f"MemAvailable:   {available_kib} kB")
    lines.append("Buffers:          100000 kB")
    path = tmp_path / "meminfo"
    path.write_text("\n".join(lines) + "\n")
    return path


def _cgroup_v2(tmp_path: Path, limit: str, current: int, inactive: int) -> Path:
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "memory.max").write_text(limit + "\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(f"anon 100\nfile 200\ninactive_file {inactive}\n")
    return root


def _cgroup_v1(tmp_path: Path, limit: int, usage: int, inactive: int) -> Path:
    root = tmp_path / "cg1"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (root / "memory" / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {inactive}\n")
    return root


def test_page_cache_counts_as_available_not_only_free_pages(tmp_path: Path) -> None:
    # a machine that ingested adapters: 1 GiB free, 16 GiB available
    meminfo = _meminfo(tmp_path, free_kib=1 << 20, available_kib=16 << 20)
    assert host_memory.available_bytes(meminfo, tmp_path / "no-cgroup") == 16 * GIB


def test_without_memavailable_the_free_pages_are_the_answer(tmp_path: Path) -> None:
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    got = host_memory.available_bytes(_meminfo(tmp_path, 1 << 20, None), tmp_path / "none")
    assert abs(got - free) < GIB  # the free pages now (they move between the two reads)
    got = host_memory.available_bytes(tmp_path / "no-meminfo", tmp_path / "none")
    assert abs(got - free) < GIB


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroup_limit_bounds_what_is_available(tmp_path: Path, version: int) -> None:
    meminfo = _meminfo(tmp_path, free_kib=8 << 20, available_kib=16 << 20)
    # a pod limited to 4 GiB that uses 3 GiB, of which 1 GiB is inactive page cache
    if version == 2:
        cgroup = _cgroup_v2(tmp_path, str(4 * GIB), current=3 * GIB, inactive=GIB)
    else:
        cgroup = _cgroup_v1(tmp_path, 4 * GIB, usage=3 * GIB, inactive=GIB)
    assert host_memory.available_bytes(meminfo, cgroup) == 2 * GIB
    assert host_memory.total_bytes(cgroup) == min(
        4 * GIB, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )


def test_an_unlimited_cgroup_leaves_the_machine_figures(tmp_path: Path) -> None:
    meminfo = _meminfo(tmp_path, free_kib=8 << 20, available_kib=16 << 20)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    v2 = _cgroup_v2(tmp_path, "max", current=3 * GIB, inactive=0)
    v1 = _cgroup_v1(tmp_path, 9223372036854771712, usage=3 * GIB, inactive=0)
    for cgroup in (v2, v1):
        assert host_memory.available_bytes(meminfo, cgroup) == 16 * GIB
        assert host_memory.total_bytes(cgroup) == physical


def test_a_cgroup_over_its_limit_has_nothing_available(tmp_path: Path) -> None:
    meminfo = _meminfo(tmp_path, free_kib=8 << 20, available_kib=16 << 20)
    cgroup = _cgroup_v2(tmp_path, str(GIB), current=2 * GIB, inactive=0)
    assert host_memory.available_bytes(meminfo, cgroup) == 0


def test_this_machine_reports_at_least_its_free_pages(tmp_path: Path) -> None:
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    # MemAvailable >= MemFree, give or take what moved between the reads (no cgroup's bound)
    assert host_memory.available_bytes(cgroup=tmp_path / "none") >= free // 2
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < host_memory.total_bytes() <= physical
