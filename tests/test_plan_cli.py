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


def test_llama_3_70b_with_2000_adapters_fits_one_h200_in_fp8_and_not_in_bf16(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 31's sizing: 141 GB of bf16 weights fit no H200; FP8 projections (a byte each
    and a scale per row) leave room for KV and adapters, and the roofline charges the torch
    path's dequantization, so the FP8 step is no faster than bf16's would be."""
    args = ["plan", "--model-shape", "llama-3-70b", "--gpu", "h200", "--adapters", "2000"]
    assert main([*args, "--json"]) == 2  # refused: the plan cannot be made
    assert "141.1 GB in bfloat16) do not fit in 141.0 GB" in capsys.readouterr().err
    assert main([*args, "--quantization", "fp8", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    linear = 80 * (8192 * (8192 + 1024 + 1024 + 8192) + 3 * 8192 * 28672)
    rows = 80 * (8192 + 1024 + 1024 + 8192 + 2 * 28672 + 8192)
    other = 2 * 128256 * 8192 + (2 * 80 + 1) * 8192  # embedding, LM head, norms: in bf16
    assert memory["weights_bytes"] == linear + 4 * rows + 2 * other
    assert memory["kv_blocks"] > 0 and memory["adapters_resident"] >= 1


def test_fp8_is_refused_for_a_mixture_of_experts_as_the_engine_refuses_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "--model-shape", "qwen3-30b-a3b", "--gpu", "h200", "--adapters", "10"]
    assert main([*args, "--quantization", "fp8"]) == 2
    assert "FP8 weights of a mixture of experts are not supported yet" in capsys.readouterr().err


def test_the_roofline_charges_fp8_s_torch_path_its_dequantization_not_half_the_bytes() -> None:
    from loraplane.planner.cost import GPUS, Roofline, StepShape
    from loraplane.planner.memory import AdapterProfile
    from loraplane.planner.shapes import SHAPES

    shape, profile = SHAPES["llama-3-8b"], AdapterProfile(8)
    step = StepShape(tokens=64, seqs=64, context=64 * 512, attention=64 * 512, adapters=8,
                     adapter_bytes=8 * 80 << 20)  # fmt: skip
    bf16 = Roofline(GPUS["h200"], shape, "bfloat16", profile).step_seconds(step)
    fp8 = Roofline(GPUS["h200"], shape, "bfloat16", profile, "fp8").step_seconds(step)
    assert fp8 > 5 * bf16  # 19 more bytes moved per linear weight than bf16's 2
