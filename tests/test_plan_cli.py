"""`loraplane plan` refuses what it cannot answer, before any model work, and documents
every default in `--help`: `--plot` needs `--rate`; `--device cpu` needs a measured cost
model (`--calibrate` or `--cost`), never a GPU's roofline; `--warmup` follows `--duration`."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from loraplane.cli import build_parser, main
from loraplane.planner.cli import ArgumentsRefused, check_arguments

SHAPE = ["plan", "--model-shape", "llama-3-8b"]


def plan_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    plan: argparse.ArgumentParser = sub.choices["plan"]
    return plan


def test_plot_without_a_rate_is_refused_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "plan.png"
    assert main([*SHAPE, "--plot", str(png)]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "give --rate" in err
    assert not png.exists()


def test_cpu_without_a_measured_cost_model_is_refused_before_reading_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model"  # never read: the flags are refused first
    code = main(["plan", "--model", str(missing), "--device", "cpu", "--device-memory", "8GiB"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--device cpu" in err and "--calibrate --model DIR" in err and "--cost FILE" in err
    assert "no-such-model" not in err


def test_cpu_with_saved_costs_is_not_refused_by_the_flag_check() -> None:
    args = plan_parser().parse_args(["--model-shape", "llama-3-8b", "--device", "cpu",
                                     "--cost", "costs.json"])  # fmt: skip
    check_arguments(args)  # no ArgumentsRefused: the cost file is read later


@pytest.mark.parametrize(("duration", "warmup"), [(10, 2.0), (40, 8.0), (100, 10.0), (3, 0.6)])
def test_the_warmup_default_follows_the_duration(duration: int, warmup: float) -> None:
    args = plan_parser().parse_args(["--model-shape", "x", "--duration", str(duration)])
    check_arguments(args)
    assert args.warmup == pytest.approx(warmup)


def test_a_warmup_given_is_kept_and_one_past_the_duration_is_refused() -> None:
    args = plan_parser().parse_args(["--model-shape", "x", "--duration", "10", "--warmup", "0"])
    check_arguments(args)
    assert args.warmup == 0
    late = plan_parser().parse_args(["--model-shape", "x", "--duration", "10", "--warmup", "10"])
    with pytest.raises(ArgumentsRefused, match="--warmup 10 must be at least 0 and below"):
        check_arguments(late)


def test_a_short_duration_plans_without_a_warmup_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    start = time.monotonic()
    code = main([*SHAPE, "--gpu", "h200", "--adapters", "200", "--rate", "5", "--duration",
                 "10", "--policies", "round_robin", "--json"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["duration_s"] == 10 and out["workload"]["warmup_s"] == 2.0
    assert out["replicas"]["round_robin"] >= 1
    assert time.monotonic() - start < 60


def test_help_shows_every_default() -> None:
    plan = plan_parser()
    formatter = plan._get_formatter()
    for action in plan._actions:
        if not action.option_strings or action.dest == "help":
            continue
        text = formatter._expand_help(action) if action.help else ""
        unset = action.default is None or action.default is False
        if unset and action.dest in {"model", "model_shape", "cost", "plot", "calibrate", "json"}:
            continue  # a choice to make, a file to name, or a switch: nothing happens unasked
        assert "(default: " in text, (action.option_strings, text)
    text = plan.format_help()
    assert "--warmup SECONDS" in text and "min(10, duration / 5)" in text
    assert "(default: h100)" in text and "(default: 40.0)" in text
