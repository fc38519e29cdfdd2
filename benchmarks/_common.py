"""Shared by the benchmark scripts: timing, the machine line, `--smoke`, the results file.

Every script takes `--smoke`: the same code path at tiny sizes, in seconds, so CI sees a broken
benchmark (`make bench-smoke`). Its figures mean nothing and its goals are printed, not
enforced; it writes `results/<name>.smoke.json` (same keys, `"smoke": true`), leaving the
full-size `results/<name>.json` alone. A full-size run exits GOALS_NOT_MET when it ran to the
end but missed a goal.

A goal is met, missed or skipped. Skipped: a goal this run cannot decide, with the reason in
its "skipped" field (NEEDS_GPU: a goal only a GPU can meet, where this run measured on a CPU;
see `gpu_goal`); its figure is still reported. A ratio that lands near its goal is measured
over rounds (`median_of_rounds`): the goal is judged on their median, printed with their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
GOALS_NOT_MET = 3  # exit status: the run ended, its figures are written, a goal was missed
SMOKE_HELP = (
    "tiny sizes, seconds: checks that the benchmark runs and the shape of its results "
    "(written to results/<name>.smoke.json; goals are printed, not enforced)"
)


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    """The `--smoke` flag every benchmark script takes."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def machine() -> str:
    """A short description of where the figures were measured."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores {cpu}, {mem:.0f} GiB, Python {platform.python_version()}"


def median_seconds(fn: Callable[[int], object], repeats: int) -> float:
    """Median wall time of fn(i) over `repeats` calls."""
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


NEEDS_GPU = "needs a GPU"  # why a goal only a GPU can meet is skipped where a CPU measured it


def goal(
    figures: dict[str, float], name: str, op: str, target: float, skip: str | None = None
) -> dict[str, Any]:
    """A goal on one figure (`op` is "<=" or ">="), and whether this run met it. With `skip`
    (why; NEEDS_GPU for a goal only a GPU can meet, where this run measured on a CPU) the
    figure is reported but the goal is neither met nor missed: "met" is None."""
    if op not in ("<=", ">="):
        raise ValueError(f"goal op must be '<=' or '>=', not {op!r}")
    value = figures[name]
    met = value <= target if op == "<=" else value >= target
    return {"figure": name, "op": op, "target": target, "met": None if skip else met,
            "skipped": skip or None}  # fmt: skip


def gpu_goal(
    figures: dict[str, float], name: str, op: str, target: float, on_gpu: bool
) -> dict[str, Any]:
    """A goal only a GPU can meet: judged when this run measured on one, else skipped."""
    return goal(figures, name, op, target, skip=None if on_gpu else NEEDS_GPU)


def median_of_rounds(figures: dict[str, float], name: str, values: list[float]) -> float:
    """Record a figure measured once per round as the median of `values`, with its spread:
    `name` (the median), `name_min`, `name_max` and `name_rounds`, which `report` prints
    beside a goal on `name`. For ratios that land near their goal: one run of enough rounds
    decides the goal, where a single measurement met it in one run and missed it in the next."""
    if not values:
        raise ValueError(f"{name}: no rounds")
    figures[name] = statistics.median(values)
    figures[f"{name}_min"], figures[f"{name}_max"] = min(values), max(values)
    figures[f"{name}_rounds"] = float(len(values))
    return figures[name]


def verdict(g: dict[str, Any]) -> str:
    """A goal's outcome in a word: met, missed or skipped."""
    if g.get("skipped"):
        return "skipped"
    return "met" if g["met"] else "missed"


def _spread(figures: dict[str, float], name: str) -> str:
    if f"{name}_rounds" not in figures:
        return ""
    n, low, high = figures[f"{name}_rounds"], figures[f"{name}_min"], figures[f"{name}_max"]
    if n == 1:
        return " (1 round)"
    return f" (median of {n:.0f} rounds, spread {low:.4g}-{high:.4g})"


def results_path(name: str, smoke: bool = False) -> Path:
    """Where `report` writes a run's results: a smoke run never overwrites a full-size one."""
    return RESULTS / (f"{name}.smoke.json" if smoke else f"{name}.json")


def report(
    name: str, figures: dict[str, float], goals: list[dict[str, Any]], smoke: bool = False
) -> int:
    """Print a table, write the results file (see `results_path`) and return the exit status:
    0, or GOALS_NOT_MET when a full-size run missed a goal (a smoke run's goals never fail; a
    skipped goal is neither met nor missed). Each goal's line gives its figure, with the
    spread of its rounds where `median_of_rounds` recorded them, and a line counts met, missed and
    skipped goals."""
    width = max(len(k) for k in figures)
    print(f"{name}{' (smoke: tiny sizes, figures mean nothing)' if smoke else ''} on {machine()}")
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value:,.4g}")
    counts = {"met": 0, "missed": 0, "skipped": 0}
    for g in goals:
        outcome = verdict(g)
        counts[outcome] += 1
        said = {"met": "met", "missed": "NOT met", "skipped": f"skipped ({g['skipped']})"}
        value = figures[g["figure"]]
        print(f"  goal: {g['figure']} {g['op']} {g['target']}: {said[outcome]}"
              f" [{value:,.4g}{_spread(figures, g['figure'])}]")  # fmt: skip
    if goals:
        print(f"  goals: {counts['met']} met, {counts['missed']} missed, {counts['skipped']}"
              " skipped")  # fmt: skip
    out = results_path(name, smoke)
    out.parent.mkdir(exist_ok=True)
    body = {"figures": figures, "goals": goals, "machine": machine(), "smoke": smoke}
    out.write_text(json.dumps(body, indent=2))
    print(f"  -> {out}")
    if smoke or not counts["missed"]:
        return 0
    print(f"  {name}: a goal was not met (exit status {GOALS_NOT_MET})")
    return GOALS_NOT_MET


def cuda_time_us(fn: Callable[[], object], iters: int, graph: bool) -> float:
    """Mean microseconds per call of `fn` on CUDA, timed with CUDA events; with `graph`, `fn`
    is captured once in a CUDA graph (after a warm-up on a side stream) and its replays are
    timed. `fn` must have run once already (compiled outside any capture)."""
    import torch

    torch.cuda.synchronize()
    call: Callable[[], object] = fn
    if graph:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        call = g.replay
    call()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1000 / iters
