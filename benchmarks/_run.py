"""Run the benchmark scripts one after another: `make bench` (full size), `make bench-smoke`.

Each script in benchmarks/ whose name does not start with "_" runs in its own process, its
output passed through; one that fails or misses a goal does not stop the rest. Scripts named
`*_gpu.py` need a CUDA device: where torch sees none they are skipped with a line saying so,
except that a smoke run takes the CPU path of those in CPU_SMOKE_ARGS. (`gpu_check.sh` is the
GPU machine's runbook, tests included, and is not run here.) Each results file written is
checked for its shape (_common.report's). The summary gives each script's outcome, time and
goals (met/missed/skipped), then the goals of all scripts counted: a goal skipped for want of
a GPU (or another stated reason) is neither met nor missed. The exit status is 0 when every
script ran (or was skipped) and, at full size, missed no goal.
Run: .venv/bin/python benchmarks/_run.py [--smoke] [--skip NAME ...] [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import GOALS_NOT_MET, results_path, verdict

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SMOKE_TIMEOUT_S = 300  # a smoke run takes seconds: one past this is stuck, and fails
# the CPU path a smoke run of a *_gpu.py script takes where there is no CUDA device (the
# attention kernel through Triton's interpreter: ~20 s; the engine in fp32: ~6 s; the engine
# end to end against HF + PEFT: ~5 s, its --smoke alone takes the CPU without CUDA)
CPU_SMOKE_ARGS = {"attention_gpu": ["--device", "cpu"], "engine_gpu": [],
                  "shared_pool_gpu": ["--device", "cpu"]}  # fmt: skip


def scripts() -> list[Path]:
    """Every benchmark script, in name order."""
    return sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_"))


def shape_problems(body: Any, smoke: bool) -> list[str]:
    """What is wrong with a results file's content (report's shape), or [] if nothing."""
    if not isinstance(body, dict):
        return ["not a JSON object"]
    problems = []
    if set(body) != {"figures", "goals", "machine", "smoke"}:
        problems.append(f"keys {sorted(body)}, not figures, goals, machine, smoke")
    figures = body.get("figures")
    if not isinstance(figures, dict) or not figures:
        problems.append("figures: not a non-empty object")
        figures = {}
    for key, value in figures.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            problems.append(f"figure {key}: {value!r} is not a finite number")
    goals = body.get("goals")
    if not isinstance(goals, list):
        problems.append("goals: not a list")
        goals = []
    for g in goals:
        if not isinstance(g, dict) or set(g) != {"figure", "op", "target", "met", "skipped"}:
            problems.append(f"goal {g!r}: not figure, op, target, met, skipped")
            continue
        skipped = g["skipped"]
        judged = skipped is None and type(g["met"]) is bool
        if not (judged or (isinstance(skipped, str) and skipped and g["met"] is None)):
            problems.append(f"goal {g!r}: a verdict (met) or a reason (skipped), not both")
        elif g["figure"] not in figures or g["op"] not in ("<=", ">="):
            problems.append(f"goal {g!r}: unknown figure or op")
    if not isinstance(body.get("machine"), str):
        problems.append("machine: not a string")
    if body.get("smoke") is not smoke:
        problems.append(f"smoke: {body.get('smoke')!r}, expected {smoke}")
    return problems


def goal_counts(goals: list[dict[str, Any]]) -> dict[str, int]:
    """How many of a results file's goals were met, missed and skipped."""
    counts = {"met": 0, "missed": 0, "skipped": 0}
    for g in goals:
        counts[verdict(g)] += 1
    return counts


def run_one(script: Path, extra: list[str], timeout: float | None, smoke: bool) -> int:
    """Run one script in a session of its own; past `timeout`, interrupt it (so its cleanup
    runs: servers, the throwaway PostgreSQL), then kill what is left."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if smoke:
        # Tiny models run faster on one torch thread, and a busy machine (CI, other work)
        # stalls multi-threaded steps at every barrier: 7 s or 45 s for the same smoke run.
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(script), *extra]
    with subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True) as proc:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"{script.name}: still running after {timeout:.0f} s: interrupted", flush=True)
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return -1
        except BaseException:  # e.g. Ctrl-C here: leave no benchmark or server behind
            os.killpg(proc.pid, signal.SIGKILL)
            raise


def has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="run every script with --smoke")
    parser.add_argument("names", nargs="*", help="only these scripts (e.g. ingest tiers)")
    parser.add_argument(
        "--skip", action="append", default=[], metavar="NAME",
        help="leave this script out (repeatable; CI leaves out the *_gpu scripts' CPU smoke "
        "paths, which its test suite runs in gpu_check.sh's dry run)",
    )  # fmt: skip
    args = parser.parse_args()
    known = {s.stem for s in scripts()}
    unknown = (set(args.names) | set(args.skip)) - known
    if unknown:
        parser.error(f"no such benchmark: {', '.join(sorted(unknown))}")
    todo = [s for s in scripts() if not args.names or s.stem in args.names]
    cuda = has_cuda()
    kind = "bench-smoke" if args.smoke else "bench"
    summary: list[str] = []
    failed = missed = 0
    goals = {"met": 0, "missed": 0, "skipped": 0}
    start_all = time.monotonic()
    for script in todo:
        extra = ["--smoke"] if args.smoke else []
        note = ""
        if script.stem in args.skip:
            print(f"== {script.relative_to(REPO)}: skipped (--skip)")
            summary.append(f"skipped  {script.name:<20}  --skip")
            continue
        if script.stem.endswith("_gpu") and not cuda:
            if not (args.smoke and script.stem in CPU_SMOKE_ARGS):
                print(f"== {script.relative_to(REPO)}: skipped (needs a CUDA device; none here)")
                summary.append(f"skipped  {script.name:<20}  needs a CUDA device")
                continue
            extra += CPU_SMOKE_ARGS[script.stem]
            note = "  (its CPU path: no CUDA device)"
        print(f"== {script.relative_to(REPO)} {' '.join(extra)}".rstrip(), flush=True)
        started = time.time()
        rc = run_one(script, extra, SMOKE_TIMEOUT_S if args.smoke else None, args.smoke)
        took = f"{time.time() - started:6.1f} s"
        out = results_path(script.stem, args.smoke)
        problems: list[str] = []
        tally = ""
        if rc in (0, GOALS_NOT_MET):
            if not out.exists() or out.stat().st_mtime < started:
                problems = [f"wrote no {out.relative_to(REPO)}"]
            else:
                body = json.loads(out.read_text())
                problems = shape_problems(body, args.smoke)
                if not problems:
                    counts = goal_counts(body["goals"])
                    tally = f"  goals {counts['met']}/{counts['missed']}/{counts['skipped']}"
                    for outcome, n in counts.items():
                        goals[outcome] += n
        if problems:
            failed += 1
            print(f"{script.name}: results: {'; '.join(problems)}")
            summary.append(f"FAILED   {script.name:<20}  {took}  results: {problems[0]}")
        elif rc == 0:
            summary.append(f"ok       {script.name:<20}  {took}{tally}{note}")
        elif rc == GOALS_NOT_MET:
            missed += 1
            summary.append(f"GOALS    {script.name:<20}  {took}{tally}  a goal was not met")
        else:
            failed += 1
            summary.append(f"FAILED   {script.name:<20}  {took}  exit status {rc}")
    total = time.monotonic() - start_all
    print(f"== {kind}: {len(todo)} scripts in {total:.0f} s ({'' if cuda else 'no '}CUDA)")
    print(*(f"  {line}" for line in summary), sep="\n")
    enforced = "; smoke: printed, not enforced" if args.smoke else ""
    print(f"{kind}: goals {goals['met']} met, {goals['missed']} missed, {goals['skipped']} "
          f"skipped (per script above: met/missed/skipped{enforced})")  # fmt: skip
    if failed or missed:
        print(f"{kind}: of {len(todo)} scripts, {failed} failed and {missed} missed a goal")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
