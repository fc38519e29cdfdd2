"""Shared by the benchmark scripts: timing, the machine line, `--smoke`, the results file.

Every script takes `--smoke`: the same code path at tiny sizes, in seconds, so CI sees a broken
benchmark (`make bench-smoke`). Its figures mean nothing and its goals are printed, not
enforced; it writes `results/<name>.smoke.json` (same keys, `"smoke": true`), leaving the
full-size `results/<name>.json` alone. A full-size run exits GOALS_NOT_MET when it ran to the
end but missed a goal.
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


def goal(figures: dict[str, float], name: str, op: str, target: float) -> dict[str, Any]:
    """A goal on one figure (`op` is "<=" or ">="), and whether this run met it."""
    if op not in ("<=", ">="):
        raise ValueError(f"goal op must be '<=' or '>=', not {op!r}")
    value = figures[name]
    met = value <= target if op == "<=" else value >= target
    return {"figure": name, "op": op, "target": target, "met": met}


def results_path(name: str, smoke: bool = False) -> Path:
    """Where `report` writes a run's results: a smoke run never overwrites a full-size one."""
    return RESULTS / (f"{name}.smoke.json" if smoke else f"{name}.json")


def report(
    name: str, figures: dict[str, float], goals: list[dict[str, Any]], smoke: bool = False
) -> int:
    """Print a table, write the results file (see `results_path`) and return the exit status:
    0, or GOALS_NOT_MET when a full-size run missed a goal (a smoke run's goals never fail)."""
    width = max(len(k) for k in figures)
    print(f"{name}{' (smoke: tiny sizes, figures mean nothing)' if smoke else ''} on {machine()}")
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value:,.4g}")
    for g in goals:
        verdict = "met" if g["met"] else "NOT met"
        print(f"  goal: {g['figure']} {g['op']} {g['target']}: {verdict}")
    out = results_path(name, smoke)
    out.parent.mkdir(exist_ok=True)
    body = {"figures": figures, "goals": goals, "machine": machine(), "smoke": smoke}
    out.write_text(json.dumps(body, indent=2))
    print(f"  -> {out}")
    if smoke or all(g["met"] for g in goals):
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
