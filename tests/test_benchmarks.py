"""The benchmarks' contract with `make bench` / `make bench-smoke` (CI runs the smoke runs
themselves; these checks only read the scripts and call the shared helpers, in milliseconds)."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    """benchmarks/_common.py, writing its results under tmp_path."""
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module("_common")
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    return module


@pytest.fixture
def runner(common: ModuleType) -> ModuleType:
    return importlib.import_module("_run")


def _calls(script: Path, name: str) -> list[ast.Call]:
    tree = ast.parse(script.read_text())
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


def test_the_runner_finds_every_benchmark_script(runner: ModuleType) -> None:
    assert [p.name for p in runner.scripts()] == [p.name for p in SCRIPTS]
    assert len(SCRIPTS) >= 9


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_script_takes_smoke_and_reports_under_its_own_name_with_it(script: Path) -> None:
    assert _calls(script, "add_smoke_flag"), f"{script.name} has no --smoke flag"
    reports = _calls(script, "report")
    # the runner looks for results/<script stem>[.smoke].json: exactly one report under the stem;
    # a variant (engine_cpu --family qwen3) reports under the stem and a suffix (an f-string)
    main = [c for c in reports if isinstance(c.args[0], ast.Constant)]
    assert [c.args[0].value for c in main] == [script.stem], f"{script.name} should report once"
    for call in reports:
        if call not in main:
            first = call.args[0]
            assert isinstance(first, ast.JoinedStr), f"{script.name}: a variant's name is built"
            head = first.values[0]
            assert isinstance(head, ast.Constant) and head.value == f"{script.stem}_", head
        assert [k.arg for k in call.keywords] == ["smoke"], f"{script.name}: report(..., smoke=)"


def test_skip_leaves_a_script_out_said_in_the_summary_and_an_unknown_name_is_refused(
    runner: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []
    monkeypatch.setattr(runner, "run_one", lambda script, *_: ran.append(script.stem) or 1)
    monkeypatch.setattr(runner, "has_cuda", lambda: False)
    monkeypatch.setattr("sys.argv", ["_run.py", "--smoke", "--skip", "ingest", "ingest", "pins"])
    assert runner.main() != 0  # pins "failed" (rc 1 here)
    assert ran == ["pins"]
    out = capsys.readouterr().out
    assert "skipped  ingest.py" in out and "--skip" in out
    monkeypatch.setattr("sys.argv", ["_run.py", "--smoke", "--skip", "no-such-script"])
    with pytest.raises(SystemExit) as refused:
        runner.main()
    assert refused.value.code == 2
    assert "no such benchmark: no-such-script" in capsys.readouterr().err


def test_the_gpu_runbook_takes_smoke_and_skips_without_cuda() -> None:
    text = (BENCH / "gpu_check.sh").read_text()
    assert "--smoke)" in text
    assert "no CUDA device: skipped" in text


def test_a_smoke_report_writes_the_same_shape_marked_smoke_and_never_fails(
    common: ModuleType, runner: ModuleType, tmp_path: Path
) -> None:
    figures = {"tokens_per_s": 1.5, "failed": 0.0}
    goals = [common.goal(figures, "tokens_per_s", ">=", 100.0)]  # not met
    assert common.report("demo", figures, goals, smoke=True) == 0
    body = json.loads((tmp_path / "demo.smoke.json").read_text())
    assert set(body) == {"figures", "goals", "machine", "smoke"}
    assert body["smoke"] is True
    assert body["figures"] == figures
    assert body["goals"] == [{"figure": "tokens_per_s", "op": ">=", "target": 100.0, "met": False,
                              "skipped": None}]  # fmt: skip
    assert runner.shape_problems(body, smoke=True) == []
    assert not (tmp_path / "demo.json").exists(), "a smoke run overwrote the full-size results"


def test_a_full_size_run_that_misses_a_goal_exits_GOALS_NOT_MET_with_its_results_written(
    common: ModuleType, runner: ModuleType, tmp_path: Path
) -> None:
    figures = {"ratio": 0.5}
    missed = [common.goal(figures, "ratio", ">=", 0.9)]
    assert common.report("demo", figures, missed) == common.GOALS_NOT_MET
    body = json.loads((tmp_path / "demo.json").read_text())
    assert body["smoke"] is False
    assert runner.shape_problems(body, smoke=False) == []
    assert common.report("demo", figures, [common.goal(figures, "ratio", "<=", 0.9)]) == 0


def test_the_shape_check_names_what_is_wrong(runner: ModuleType) -> None:
    good = {
        "figures": {"a": 1.0},
        "goals": [{"figure": "a", "op": "<=", "target": 2, "met": True, "skipped": None}],
        "machine": "m",
        "smoke": True,
    }
    assert runner.shape_problems(good, smoke=True) == []
    assert runner.shape_problems(good, smoke=False) == ["smoke: True, expected False"]
    nan = {**good, "figures": {"a": float("nan")}}
    assert runner.shape_problems(nan, smoke=True) == ["figure a: nan is not a finite number"]
    unknown = {**good, "goals": [{**good["goals"][0], "figure": "b"}]}
    assert "unknown figure" in runner.shape_problems(unknown, smoke=True)[0]
    both = {**good, "goals": [{**good["goals"][0], "skipped": "needs a GPU"}]}
    assert "not both" in runner.shape_problems(both, smoke=True)[0]
    neither = {**good, "goals": [{**good["goals"][0], "met": None}]}
    assert "not both" in runner.shape_problems(neither, smoke=True)[0]
    old = {**good, "goals": [{"figure": "a", "op": "<=", "target": 2, "met": True}]}
    assert "not figure, op, target, met, skipped" in runner.shape_problems(old, smoke=True)[0]
    missing = {k: v for k, v in good.items() if k != "machine"}
    assert runner.shape_problems(missing, smoke=True)[0].startswith("keys ")


def test_a_gpu_goal_measured_on_a_cpu_is_skipped_never_met_nor_missed(
    common: ModuleType, runner: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = {"speedup": 1.2, "cost": 1.0}
    goals = [common.gpu_goal(figures, "speedup", ">=", 5.0, on_gpu=False),
             common.goal(figures, "cost", "<=", 1.1)]  # fmt: skip
    assert goals[0]["met"] is None and goals[0]["skipped"] == common.NEEDS_GPU
    assert common.report("demo", figures, goals) == 0  # the miss it would be does not count
    out = capsys.readouterr().out
    assert "speedup >= 5.0: skipped (needs a GPU)" in out
    assert "goals: 1 met, 0 missed, 1 skipped" in out
    body = json.loads((tmp_path / "demo.json").read_text())
    assert runner.shape_problems(body, smoke=False) == []
    assert runner.goal_counts(body["goals"]) == {"met": 1, "missed": 0, "skipped": 1}
    on_gpu = common.gpu_goal(figures, "speedup", ">=", 5.0, on_gpu=True)
    assert on_gpu["met"] is False and on_gpu["skipped"] is None
    assert common.report("demo", figures, [on_gpu]) == common.GOALS_NOT_MET


def test_rounds_record_the_median_and_the_spread_printed_beside_the_goal(
    common: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    figures: dict[str, float] = {}
    assert common.median_of_rounds(figures, "zipf", [0.92, 0.889, 0.905, 0.91, 0.899]) == 0.905
    assert figures == {"zipf": 0.905, "zipf_min": 0.889, "zipf_max": 0.92, "zipf_rounds": 5.0}
    assert common.report("demo", figures, [common.goal(figures, "zipf", ">=", 0.9)]) == 0
    assert "zipf >= 0.9: met [0.905 (median of 5 rounds, spread 0.889-0.92)]" in (
        capsys.readouterr().out
    )
    with pytest.raises(ValueError, match="no rounds"):
        common.median_of_rounds(figures, "empty", [])


def test_a_goal_with_an_unknown_op_is_refused(common: ModuleType) -> None:
    with pytest.raises(ValueError, match="op"):
        common.goal({"a": 1.0}, "a", "<", 2.0)


# The variants `make bench-smoke` does not run (it runs each script once, plain): each at
# smoke size in its own process (a benchmark sets torch's threads and imports transformers),
# results under tmp_path; the figures each must write and the goals it states.
VARIANTS: dict[str, tuple[list[str], str, list[str]]] = {
    "gemma3": (["engine_cpu.py", "--family", "gemma3"], "engine_cpu_gemma3",
               ["gemma3_over_llama_no_adapters", "gemma3_over_llama_8_adapters"]),
    "gemma2": (["engine_cpu.py", "--family", "gemma2"], "engine_cpu_gemma2",
               ["gemma2_over_llama_no_adapters", "gemma2_over_llama_8_adapters"]),
    "mixtral": (["engine_cpu.py", "--family", "mixtral"], "engine_cpu_mixtral",
                ["mixtral_8_adapters_over_base"]),
    "qwen3_moe": (["engine_cpu.py", "--family", "qwen3_moe"], "engine_cpu_qwen3_moe",
                  ["qwen3_moe_8_adapters_over_base"]),
    # no goal: the split step's figures (communication, step message, compute) only
    "tp2": (["engine_cpu.py", "--tp", "2"], "engine_cpu_tp2", []),
    "tiers-qwen3": (["tiers.py", "--family", "qwen3"], "tiers_qwen3",
                    ["rank_exact_step_ratio", "zipf_over_eight_adapters",
                     "uniform_over_eight_adapters", "eight_auto_over_max8"]),
    "tiers-gemma3": (["tiers.py", "--family", "gemma3"], "tiers_gemma3",
                     ["rank_exact_step_ratio", "zipf_over_eight_adapters",
                      "uniform_over_eight_adapters", "eight_auto_over_max8"]),
}  # fmt: skip
_RUN_VARIANT = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import _common
_common.RESULTS = Path(sys.argv[2])
script = sys.argv[3]
sys.argv = sys.argv[3:]
module = __import__(Path(script).stem)
sys.exit(module.main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_family_variant_runs_at_smoke_size_and_writes_its_goals(
    variant: str, runner: ModuleType, tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    args, name, goal_figures = VARIANTS[variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(BENCH.parent)}
    done = subprocess.run(
        [sys.executable, "-c", _RUN_VARIANT, str(BENCH), str(tmp_path), *args, "--smoke"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    body = json.loads((tmp_path / f"{name}.smoke.json").read_text())
    assert runner.shape_problems(body, smoke=True) == []
    assert set(goal_figures) <= {g["figure"] for g in body["goals"]}
    assert all(body["figures"][f] > 0 for f in goal_figures)
    assert not list(tmp_path.glob("tmp*")), "the benchmark left its models behind"
