"""benchmarks/gpu_check.sh, the lent GPU's one run: its dry run works where there is no GPU,
and its steps' time limits fit one 10-minute command on the lent machine, with room."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
STEPS = ("tests-gpu", "tests-cuda", "bench", "shared-pool", "attention", "engine")


def _step_limits() -> dict[str, int]:
    """Each step's time limit in seconds, as the script's `step` / `bench_step` calls say."""
    calls = re.findall(r"^(?:step|bench_step) (\S+) (\d+) ", SCRIPT.read_text(), re.MULTILINE)
    return {name: int(seconds) for name, seconds in calls}


def test_the_step_limits_add_up_to_at_most_520_s_so_the_run_ends_within_9_minutes() -> None:
    limits = _step_limits()
    assert set(limits) == set(STEPS)
    assert sum(limits.values()) <= 520, limits
    # what each took on the first H200 run (2026-12-04), with room
    took = {"tests-gpu": 90, "tests-cuda": 40, "engine": 139, "bench": 10, "shared-pool": 55,
            "attention": 13}  # fmt: skip
    assert all(limits[k] >= 1.2 * v for k, v in took.items()), limits


@pytest.mark.slow
def test_the_dry_run_runs_each_step_in_its_cpu_form_or_says_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """About 45 s on 2 cores; rewrites the (git-ignored) smoke results under
    benchmarks/results, as `make bench-smoke` does."""
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    run = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=240, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = (out / "summary.txt").read_text().splitlines()
    for name in STEPS:
        (line,) = [ln for ln in lines if ln.split()[1:2] in ([name], [f"{name}:"])]
        status, _, reason = line.strip().partition(" ")
        assert status in ("ok", "skipped"), line
        if status == "skipped":
            assert "needs CUDA" in reason, line
    (engine,) = [ln for ln in lines if ln.split()[1:2] == ["engine"]]
    assert engine.split()[0] == "ok", "engine_gpu.py has a CPU smoke path"

    # CI's bench-smoke leaves these CPU paths to this dry run (.ci/run): their results' shape
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    shape_problems = importlib.import_module("_run").shape_problems
    for script in ("engine_gpu", "shared_pool_gpu", "attention_gpu"):
        result = json.loads((out / f"{script}.smoke.json").read_text())
        assert shape_problems(result, smoke=True) == [], script
    body = json.loads((out / "engine_gpu.smoke.json").read_text())
    figures = body["figures"]
    for key in ("load_s", "load_peak_host_over_checkpoint", "decode_step_ms_0_adapters",
                "decode_step_ms_8_adapters", "decode_step_ms_64_adapters",
                "decode_step_over_roofline_8_adapters", "lora_cost_over_traffic_bound",
                "engine_over_hf_peft_tokens_per_s", "greedy_within_tol_fraction"):  # fmt: skip
        assert key in figures, key
    assert figures["failed_phases"] == 0
    assert figures["greedy_match_fraction"] == 1.0, "fp32 on CPU: HF + PEFT's tokens exactly"
    assert figures["checkpoint_shards"] > 1, "the load must read a sharded checkpoint"
    # the graph phase ran through the interpreter and an emulated capture, and replayed
    assert figures["graph_replays"] >= 1 and figures["graph_fallbacks"] == 0
    assert figures["graphs_greedy_match_fraction"] == 1.0
    # the decode matrix: every case in its smoke form (1 and 2 rows over 1 and 2 adapters),
    # eager and from the graphs, each with its roofline and host time
    for case in [f"{r}r_{a}a_{s}_{m}" for r in (1, 2) for a in (1, 2)
                 for s in ("greedy", "sampled") for m in ("eager", "graphs")]:  # fmt: skip
        for figure in ("decode_step_ms", "host_ms", "host_fraction", "decode_over_roofline"):
            assert f"{figure}_{case}" in figures, (figure, case)
        assert 0 <= figures[f"host_fraction_{case}"] <= 1
        assert figures[f"roofline_ms_{case}"] > 0
    assert figures["logits_mib_2r_sampled"] == 3 * figures["logits_mib_2r_greedy"]
    assert figures["graph_replays_matrix"] >= 16, "each graph case's 2 timed steps replayed"


def test_steps_and_budget_pick_what_runs_and_a_step_without_time_is_skipped_by_name(
    tmp_path: Path,
) -> None:
    """--steps runs only the steps it names; --budget leaves a step with under 20 s unrun,
    said in the summary (a second call on the lent GPU for what the first had no time for)."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--steps", "tests-gpu,attention", "--budget", "5"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [ln.strip() for ln in (out / "summary.txt").read_text().splitlines()[1:]]
    assert lines == [
        "skipped tests-gpu: no time left in the 5 s budget",
        "skipped attention: no time left in the 5 s budget",
    ], lines


def test_the_eager_step_profiler_runs_its_cpu_check_and_prints_each_table() -> None:
    """benchmarks/_profile_gpu.py (where an eager decode step's time goes on a GPU) in its CPU
    check: both cases, the operators' table and the host's Python profile."""
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "_profile_gpu.py"), "--check-on-cpu",
         "--rows", "2", "--adapters", "2", "--steps", "1", "--top", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "== base: eager decode step" in run.stdout
    assert "== 2 adapters: eager decode step" in run.stdout
    assert run.stdout.count("Self CPU time total") == 2
    assert run.stdout.count("Ordered by: internal time") == 2
