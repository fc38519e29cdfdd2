"""The engine's CPU budget: a container's CPU limit caps torch's thread team (cpus.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplane.dataplane import cpus


def _v2(root: Path, own: str, limits: dict[str, str]) -> Path:
    """A cgroup v2 tree under `root` (cpu.max per folder) and a /proc/self/cgroup naming `own`."""
    (root / "cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for folder, text in limits.items():
        path = root / folder.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        (path / "cpu.max").write_text(text + "\n")
    proc = root.parent / "proc-cgroup"
    proc.write_text(f"0::{own}\n")
    return proc


def test_v2_limit_is_read_at_the_mount_point_as_in_a_container(tmp_path: Path) -> None:
    proc = _v2(tmp_path / "cg", "/", {"/": "200000 100000"})
    assert cpus.cgroup_cpu_limit(tmp_path / "cg", proc) == 2.0


def test_v2_no_limit_reads_none(tmp_path: Path) -> None:
    proc = _v2(tmp_path / "cg", "/", {"/": "max 100000"})
    assert cpus.cgroup_cpu_limit(tmp_path / "cg", proc) is None


def test_v2_the_tightest_limit_along_the_path_binds(tmp_path: Path) -> None:
    # the pod's limit (1.5 CPUs) is above the container's folder, which has none of its own
    proc = _v2(
        tmp_path / "cg",
        "/kubepods/pod1/ctr",
        {"/": "max 100000", "/kubepods": "800000 100000", "/kubepods/pod1": "150000 100000",
         "/kubepods/pod1/ctr": "max 100000"},
    )  # fmt: skip
    assert cpus.cgroup_cpu_limit(tmp_path / "cg", proc) == 1.5


@pytest.mark.parametrize("text", ["", "garbage", "0 100000", "100000 0", "max"])
def test_v2_unreadable_or_odd_values_are_no_limit(tmp_path: Path, text: str) -> None:
    proc = _v2(tmp_path / "cg", "/", {"/": text})
    assert cpus.cgroup_cpu_limit(tmp_path / "cg", proc) is None


def test_v1_quota_over_period(tmp_path: Path) -> None:
    folder = tmp_path / "cg" / "cpu,cpuacct"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:cpu,cpuacct:/\n3:memory:/\n")
    assert cpus.cgroup_cpu_limit(tmp_path / "cg", proc) == 3.0
    (folder / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cpus.cgroup_cpu_limit(tmp_path / "cg", proc) is None


def test_no_cgroup_files_is_no_limit(tmp_path: Path) -> None:
    assert cpus.cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent-proc") is None


def test_usable_cpus_is_the_affinity_capped_by_the_limit_rounded_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 64)
    proc = _v2(tmp_path / "cg", "/", {"/": "250000 100000"})
    assert cpus.usable_cpus(tmp_path / "cg", proc) == 2  # 2.5 CPUs: a team of 2, never 3
    (tmp_path / "cg" / "cpu.max").write_text("50000 100000\n")
    assert cpus.usable_cpus(tmp_path / "cg", proc) == 1  # half a CPU: still one thread
    (tmp_path / "cg" / "cpu.max").write_text("max 100000\n")
    assert cpus.usable_cpus(tmp_path / "cg", proc) == 64
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 4)
    (tmp_path / "cg" / "cpu.max").write_text("1600000 100000\n")  # a limit above the mask
    assert cpus.usable_cpus(tmp_path / "cg", proc) == 4


def test_engine_threads_share_the_cpus_out_and_honour_the_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(cpus.ENV, raising=False)
    assert [cpus.engine_threads(ranks, cpus=8) for ranks in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv(cpus.ENV, "3")
    assert cpus.engine_threads(2, cpus=8) == 3
    for bad in ("0", "-2", "two", ""):
        monkeypatch.setenv(cpus.ENV, bad)
        with pytest.raises(ValueError, match=cpus.ENV):
            cpus.engine_threads()


def test_size_torch_threads_caps_the_team_and_keeps_a_smaller_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv(cpus.ENV, raising=False)
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(cpus, "usable_cpus", lambda *a: 2)  # a 2-CPU container limit
        assert cpus.size_torch_threads() == 2 and torch.get_num_threads() == 2
        assert cpus.size_torch_threads(ranks=2) == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(cpus, "usable_cpus", lambda *a: 64)
        assert cpus.size_torch_threads() == 1  # a smaller team set before stays
        monkeypatch.setenv(cpus.ENV, "2")
        assert cpus.size_torch_threads() == 2 and torch.get_num_threads() == 2  # exactly
    finally:
        torch.set_num_threads(before)
