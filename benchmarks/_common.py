"""Shared by the benchmark scripts: timing, the machine line, the results file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


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
    value = figures[name]
    met = value <= target if op == "<=" else value >= target
    return {"figure": name, "op": op, "target": target, "met": met}


def report(name: str, figures: dict[str, float], goals: list[dict[str, Any]]) -> Path:
    """Print a table and write benchmarks/results/<name>.json; return its path."""
    width = max(len(k) for k in figures)
    print(f"{name} on {machine()}")
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value:,.4g}")
    for g in goals:
        verdict = "met" if g["met"] else "NOT met"
        print(f"  goal: {g['figure']} {g['op']} {g['target']}: {verdict}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps({"figures": figures, "goals": goals, "machine": machine()}, indent=2))
    print(f"  -> {out}")
    return out
