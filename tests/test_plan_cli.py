"""`loraplane plan` refuses what it cannot answer, before any model work, and documents
every default in `--help`: `--plot` needs `--rate`; `--device cpu` needs a measured cost
model (`--calibrate` or `--cost`), never a GPU's roofline; `--warmup` follows `--duration`.
A base that fits no single GPU gets the layouts compared (FP8 on one, tensor-parallel on
2, 4, 8), the cheapest named and planned; splits the data plane cannot serve are refused."""

from __future__ import annotations

import argparse
import json
import math
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
    # refused when that layout is asked for (unasked, the planner compares layouts instead)
    assert main([*args, "--tensor-parallel-size", "1", "--json"]) == 2
    assert "141.1 GB in bfloat16) do not fit in 141.0 GB" in capsys.readouterr().err
    assert main([*args, "--quantization", "fp8", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    linear = 80 * (8192 * (8192 + 1024 + 1024 + 8192) + 3 * 8192 * 28672)
    rows = 80 * (8192 + 1024 + 1024 + 8192 + 2 * 28672 + 8192)
    other = 2 * 128256 * 8192 + (2 * 80 + 1) * 8192  # embedding, LM head, norms: in bf16
    assert memory["weights_bytes"] == linear + 4 * rows + 2 * other
    assert memory["kv_blocks"] > 0 and memory["adapters_resident"] >= 1


def test_fp8_of_a_mixture_of_experts_quantizes_every_expert_and_keeps_the_routers_16_bit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Mixtral-8x7B: every expert's w1/w3/w2 and the attention projections a byte a weight
    plus an fp32 scale per output row, the routers with the embeddings, norms and LM head in
    bf16, as the data plane loads them."""
    args = ["plan", "--model-shape", "mixtral-8x7b", "--gpu", "h200", "--adapters", "10"]
    assert main([*args, "--quantization", "fp8", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    attention = 4096 * (4096 + 1024 + 1024) + 4096 * 4096
    experts = 8 * 3 * 4096 * 14336
    rows = 4096 + 1024 + 1024 + 4096 + 8 * (14336 + 14336 + 4096)
    routers = 32 * 4096 * 8
    other = 2 * 32000 * 4096 + (2 * 32 + 1) * 4096 + routers
    assert memory["weights_bytes"] == 32 * (attention + experts + 4 * rows) + 2 * other
    assert main([*args, "--quantization", "int4", "--tensor-parallel-size", "2"]) == 0


def test_the_roofline_charges_fp8_its_kernel_s_byte_or_the_torch_path_s_dequantization() -> None:
    """On a GPU with FP8 in hardware (H200) the W8A16 kernel reads a byte per weight; on one
    without (A100) FP8 weights take the torch path, which rebuilds the 16-bit weight."""
    from loraplane.planner.cost import GPUS, Roofline, StepShape
    from loraplane.planner.memory import AdapterProfile
    from loraplane.planner.shapes import SHAPES

    shape, profile = SHAPES["llama-3-8b"], AdapterProfile(8)
    step = StepShape(tokens=64, seqs=64, context=64 * 512, attention=64 * 512, adapters=8,
                     adapter_bytes=8 * 80 << 20)  # fmt: skip
    bf16 = Roofline(GPUS["h200"], shape, "bfloat16", profile).step_seconds(step)
    fp8 = Roofline(GPUS["h200"], shape, "bfloat16", profile, "fp8").step_seconds(step)
    assert 0.5 * bf16 < fp8 < 0.75 * bf16  # half the weights' bytes; the KV cache's the same
    bf16 = Roofline(GPUS["a100-80gb"], shape, "bfloat16", profile).step_seconds(step)
    fp8 = Roofline(GPUS["a100-80gb"], shape, "bfloat16", profile, "fp8").step_seconds(step)
    assert fp8 > 5 * bf16  # 19 more bytes moved per linear weight than bf16's 2


# Llama-3-70B by hand: 80 layers, hidden 8192, 64 heads and 8 KV heads of 128, MLP 28672,
# vocabulary 128256 (untied), 2 bytes a parameter in bfloat16
L, H, KV, FF, VOCAB = 80, 8192, 1024, 28672, 128256
NORMS = (2 * L + 1) * H


def llama_70b_rank_weights(n: int) -> int:
    """One rank's bytes of a split over `n`: its heads, KV heads, MLP columns and vocabulary
    rows (padded), the norms whole."""
    linear = L * (2 * H * H // n + 2 * H * KV // n + 3 * H * FF // n)
    return 2 * (linear + 2 * -(-VOCAB // n) * H + NORMS)


def test_llama_3_70b_with_2000_adapters_names_fp8_on_one_h200_and_bf16_on_two(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 31's goal: unasked (bf16 fits no H200), the plan compares the layouts, names FP8
    on one H200 the cheapest and TP=2 in bf16 the one on two, each with its memory split, and
    says why bf16 on one does not fit."""
    args = ["plan", "--model-shape", "llama-3-70b", "--gpu", "h200", "--adapters", "2000"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = {item["layout"]: item for item in out["layouts"]}
    assert out["recommended_layout"] == "fp8, 1 GPU"
    assert out["quantization"] == "fp8" and out["tensor_parallel_size"] == 1

    fp8, tp2 = layouts["fp8, 1 GPU"], layouts["bfloat16, TP=2"]
    assert fp8["fits"] and fp8["gpus"] == 1
    assert tp2["fits"] and tp2["gpus"] == 2
    assert tp2["weights_bytes_per_gpu"] == llama_70b_rank_weights(2) == 70_555_025_408
    assert fp8["weights_bytes_per_gpu"] == out["memory"]["weights_bytes"]
    for item in (fp8, tp2):  # each GPU's split: the engine's rule, within the device
        free = 141 * 10**9 - item["weights_bytes_per_gpu"]
        assert item["lora_budget_bytes_per_gpu"] == int(free * 0.1)
        assert item["kv_cache_bytes_per_gpu"] <= int(free * 0.85) - int(free * 0.1)
        assert item["adapters_resident"] >= 1 and item["kv_tokens"] >= 8192
    # two GPUs hold half the KV heads each: per token 160 KiB a GPU, more than twice the tokens
    assert tp2["kv_cache_bytes_per_gpu"] // (2 * L * 4 * 128 * 2) == tp2["kv_tokens"]
    assert tp2["kv_tokens"] > 2 * fp8["kv_tokens"]
    one = layouts["bfloat16, 1 GPU"]
    assert not one["fits"] and one["why_not"] == "weights 141.1 GB > 141.0 GB of device memory"
    assert [layouts[f"bfloat16, TP={n}"]["gpus"] for n in (4, 8)] == [4, 8]

    assert main(args) == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.startswith("  fp8, 1 GPU")
            or line.startswith("  bfloat16, TP=2 ")]  # fmt: skip
    assert rows[0][:6] == ["fp8,", "1", "GPU", "1", "72.7", "GB"]  # cheapest first
    assert rows[1][:5] == ["bfloat16,", "TP=2", "2", "70.6", "GB"]
    assert "recommended: fp8, 1 GPU" in text
    assert "bfloat16, 1 GPU              -  does not fit: weights 141.1 GB > 141.0 GB" in text


def test_with_a_rate_the_layouts_are_sized_by_the_fleet_in_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With a load, a layout's GPUs are its replicas for the p99 TTFT target times its GPUs
    per replica; on an H200 (the W8A16 kernel) FP8 on one GPU is the cheapest, on an A100
    (the torch path: a 70B decode step of ~0.4 s) it meets no target and a split wins."""
    args = ["plan", "--model-shape", "llama-3-70b", "--gpu", "h200", "--adapters", "2000",
            "--rate", "2", "--policies", "round_robin", "--max-replicas", "8",
            "--json"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    layouts = {item["layout"]: item for item in out["layouts"]}
    tp2 = layouts["bfloat16, TP=2"]
    assert tp2["gpus"] == 2 * tp2["replicas"]
    assert layouts["fp8, 1 GPU"]["gpus"] == layouts["fp8, 1 GPU"]["replicas"] < tp2["gpus"]
    assert out["recommended_layout"] == "fp8, 1 GPU"
    n = out["replicas"]["round_robin"]
    assert n == layouts["fp8, 1 GPU"]["replicas"] and out["gpus"]["round_robin"] == n
    args[args.index("h200")] = "a100-80gb"
    assert main(args) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    layouts = {item["layout"]: item for item in out["layouts"]}
    assert layouts["fp8, 1 GPU"]["gpus"] is None or not layouts["fp8, 1 GPU"]["fits"]
    assert ", TP=" in out["recommended_layout"]  # fp8 over 2 GPUs, fewer than bfloat16's


def test_tensor_parallel_size_2_prints_each_gpu_s_split(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "--model-shape", "llama-3-70b", "--gpu", "h200", "--adapters", "2000",
            "--tensor-parallel-size", "2"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "memory per GPU (each of the replica's 2):" in text
    assert "  weights             70.56 GB  50%  (141.11 GB in all, split 2 ways)" in text
    assert "160 KiB per token on each GPU, 4 of 8 KV heads" in text
    assert "layouts on" not in text  # a layout was asked for: no comparison
    assert "2 all-reduces per layer" in text and "not measured on a GPU" in text


def test_fp8_split_over_2_gpus_holds_half_of_fp8_s_weights_on_each_and_is_compared(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """FP8 under tensor parallelism: each GPU holds its slice of the one-byte weights and the
    scales of its rows (o and down keep every row's); on an H100, where 70B in bfloat16 over
    two GPUs leaves 7 GB per GPU for the KV cache, FP8 over two holds 4x the tokens and runs
    3x the rows."""
    base = ["plan", "--model-shape", "llama-3-70b", "--gpu", "h200", "--adapters", "2000",
            "--quantization", "fp8", "--json"]  # fmt: skip
    assert main(base) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*base, "--tensor-parallel-size", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert (two["quantization"], two["tensor_parallel_size"]) == ("fp8", 2)
    assert 0.5 < two["memory"]["weights_bytes"] / one["memory"]["weights_bytes"] < 0.51
    h100 = ["plan", "--model-shape", "llama-3-70b", "--gpu", "h100", "--adapters", "2000",
            "--recommend-layout", "--json"]  # fmt: skip
    assert main(h100) == 0
    layouts = {item["layout"]: item for item in json.loads(capsys.readouterr().out)["layouts"]}
    fp8, bf16 = layouts["fp8, TP=2"], layouts["bfloat16, TP=2"]
    assert fp8["fits"] and bf16["fits"]
    assert fp8["weights_bytes_per_gpu"] < 0.52 * bf16["weights_bytes_per_gpu"]
    assert fp8["kv_tokens"] > 4 * bf16["kv_tokens"] and fp8["rows"] > 3 * bf16["rows"]


def test_a_model_that_fits_one_gpu_gets_no_layout_table_unless_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*SHAPE, "--gpu", "h200", "--json"]) == 0
    assert "layouts" not in json.loads(capsys.readouterr().out)
    assert main([*SHAPE, "--gpu", "h200", "--recommend-layout", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended_layout"] == "bfloat16, 1 GPU"
    assert all(item["fits"] for item in out["layouts"])  # 8B fits every layout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model-shape", "llama-3-70b", "--tensor-parallel-size", "3"],
         "tensor parallel size 3 does not divide num_attention_heads (64)"),
        (["--model-shape", "qwen2-7b", "--tensor-parallel-size", "8"],
         "tensor parallel size 8 does not divide num_attention_heads (28)"),
    ],
)  # fmt: skip
def test_splits_the_data_plane_cannot_serve_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--gpu", "h200", "--adapters", "10", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_a_mixture_of_experts_is_planned_split_each_gpu_holding_half_of_each_expert(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", "--gpu", "h200", "--adapters", "10", "--model-shape", name, "--json"]
    assert main(base) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*base, "--tensor-parallel-size", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["tensor_parallel_size"] == 2
    # a rank holds half of every expert and the attention, the router and norms whole
    assert 0.5 < two["memory"]["weights_bytes"] / one["memory"]["weights_bytes"] < 0.55


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--recommend-layout", "--tensor-parallel-size", "2"],
         "--recommend-layout chooses --tensor-parallel-size and --quantization itself"),
        (["--recommend-layout", "--quantization", "fp8"], "--recommend-layout chooses"),
        (["--tensor-parallel-size", "2", "--cost", "costs.json"],
         "--tensor-parallel-size is planned on a GPU's roofline"),
        (["--recommend-layout", "--device", "cpu", "--cost", "costs.json"],
         "--recommend-layout is planned on a GPU's roofline"),
    ],
)  # fmt: skip
def test_layout_flags_that_cannot_be_planned_together_are_refused_first(
    flags: list[str], message: str
) -> None:
    args = plan_parser().parse_args(["--model-shape", "llama-3-70b", *flags])
    with pytest.raises(ArgumentsRefused, match=message):
        check_arguments(args)


def test_an_fp8_kv_cache_holds_twice_the_tokens_and_its_steps_read_half_the_kv_bytes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loraplane.planner.cost import GPUS, Roofline, StepShape
    from loraplane.planner.memory import AdapterProfile, arena_blocks
    from loraplane.planner.shapes import SHAPES

    args = ["plan", "--model-shape", "llama-3-8b", "--gpu", "h100", "--adapters", "100", "--json"]
    plans = {}
    for kv in ("auto", "fp8"):
        assert main([*args, "--kv-cache-dtype", kv]) == 0, capsys.readouterr().err
        plans[kv] = json.loads(capsys.readouterr().out)["memory"]
    assert plans["fp8"]["kv_bytes_per_token"] * 2 == plans["auto"]["kv_bytes_per_token"]
    assert plans["fp8"]["kv_cache_bytes"] == pytest.approx(plans["auto"]["kv_cache_bytes"], 1e-3)
    assert plans["fp8"]["kv_tokens"] == pytest.approx(2 * plans["auto"]["kv_tokens"], 1e-3)
    shape, profile = SHAPES["llama-3-8b"], AdapterProfile(8)
    # an adapter in the KV cache: the fp8 blocks hold half as many bf16 values
    assert arena_blocks(shape, profile, 16, "bfloat16", "fp8") == pytest.approx(
        2 * arena_blocks(shape, profile, 16, "bfloat16"), abs=1
    )
    step = StepShape(tokens=64, seqs=64, context=64 * 4096, attention=64 * 4096, adapters=0,
                     adapter_bytes=0)  # fmt: skip
    auto = Roofline(GPUS["h200"], shape, "bfloat16", profile).step_seconds(step)
    fp8 = Roofline(GPUS["h200"], shape, "bfloat16", profile, kv_cache_dtype="fp8")
    assert fp8.step_seconds(step) < 0.75 * auto  # long contexts: the KV bytes dominate


def test_int4_plans_half_a_byte_a_weight_and_its_groups_and_the_roofline_reads_that(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--quantization int4 (a 4-bit checkpoint): the projections at half a byte per weight
    plus a 16-bit scale and a zero byte per group of 128, the rest in --dtype; the step
    reads fewer bytes than FP8's, and it splits over GPUs as the data plane splits it."""
    from loraplane.planner.cost import GPUS, Roofline, StepShape
    from loraplane.planner.memory import AdapterProfile, weights_bytes
    from loraplane.planner.shapes import named_shape

    shape = named_shape("llama-3-70b")
    linear, others = shape.linear_params(), shape.num_params() - shape.linear_params()
    int4 = weights_bytes(shape, "bfloat16", "int4")
    assert int4 == 2 * others + math.ceil(linear * (0.5 + 3 / 128))
    assert 39e9 < int4 < 41e9 < weights_bytes(shape, "bfloat16", "fp8")
    step = StepShape(tokens=1, seqs=1, context=1000, attention=1000, adapters=1, adapter_bytes=0)
    seconds = {
        form: Roofline(GPUS["h200"], shape, "bfloat16", AdapterProfile(1), form).step_seconds(step)
        for form in (None, "fp8", "int4")
    }
    assert seconds["int4"] < 0.6 * seconds["fp8"] < 0.6 * seconds[None]
    args = ["plan", "--model-shape", "llama-3-70b", "--gpu", "h100", "--adapters", "2000",
            "--quantization", "int4", "--json"]  # fmt: skip
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["quantization"] == "int4" and one["memory"]["weights_bytes"] == int4
    assert main([*args, "--tensor-parallel-size", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert 0.5 < two["memory"]["weights_bytes"] / int4 < 0.51


def _checkpoint(tmp_path: Path, name: str, quantization_config: dict[str, object] | None) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16"}  # fmt: skip
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_quantized_checkpoint_is_planned_as_it_is_stored_and_contrary_flags_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    awq = _checkpoint(tmp_path, "awq", {"quant_method": "awq", "bits": 4, "group_size": 128})
    fp8 = _checkpoint(tmp_path, "fp8", {"quant_method": "compressed-tensors",
                                        "format": "float-quantized"})  # fmt: skip
    plain = _checkpoint(tmp_path, "plain", None)
    base = ["plan", "--gpu", "h100", "--adapters", "100", "--json"]
    forms = {}
    for folder in (awq, fp8, plain):
        assert main([*base, "--model", str(folder)]) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        forms[folder.name] = (out["quantization"], out["memory"]["weights_bytes"])
    assert forms["awq"][0] == "int4" and forms["fp8"][0] == "fp8" and forms["plain"][0] is None
    assert forms["awq"][1] < forms["fp8"][1] < forms["plain"][1]
    # compared in its own form only, on 1 to 8 GPUs
    assert main([*base, "--model", str(awq), "--recommend-layout"]) == 0
    layouts = [item["layout"] for item in json.loads(capsys.readouterr().out)["layouts"]]
    assert layouts == ["int4, 1 GPU", "int4, TP=2", "int4, TP=4", "int4, TP=8"]
    for folder, flag, message in (
        (awq, "fp8", "is a 4-bit checkpoint, served as it is stored: give --quantization int4"),
        (fp8, "int4", "is an FP8 checkpoint, served as it is stored: give --quantization fp8"),
        (plain, "int4", "holds 16-bit weights: the data plane reads 4-bit weights from"),
    ):
        assert main([*base, "--model", str(folder), "--quantization", flag]) == 2
        assert message in capsys.readouterr().err


def test_4_bit_groups_that_a_split_would_cut_are_refused_as_the_data_plane_refuses_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen2-72B's MLP (29,568 columns) leaves 14,784, 7,392 and 3,696 inputs of down_proj per
    GPU over 2, 4 and 8, none of them whole groups of 128: a 4-bit Qwen2-72B is served whole."""
    config: dict[str, object] = {
        "model_type": "qwen2", "num_hidden_layers": 80, "hidden_size": 8192,
        "intermediate_size": 29568, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 152064, "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
    }  # fmt: skip
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    folder = tmp_path / "qwen2-72b-awq"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    base = ["plan", "--model", str(folder), "--gpu", "h200", "--adapters", "100"]
    assert main([*base, "--tensor-parallel-size", "8"]) == 2
    assert (
        "4-bit weights in groups of 128 inputs do not split over 8 GPUs: down_proj's 29,568 inputs"
        " leave 3,696 per GPU, not whole groups" in capsys.readouterr().err
    )
    assert main([*base, "--recommend-layout", "--json"]) == 0
    layouts = {item["layout"]: item for item in json.loads(capsys.readouterr().out)["layouts"]}
    assert layouts["int4, 1 GPU"]["fits"]
    for n in (2, 4, 8):
        assert "do not split over" in layouts[f"int4, TP={n}"]["why_not"]


def test_a_4_bit_checkpoint_s_own_group_size_decides_its_splits_and_unserved_forms_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint's group size, not 128: a GPTQ Qwen2-72B in groups of 64 leaves 14,784
    down_proj inputs per GPU over 2 (231 groups), 7,392 over 4 (115.5: refused). A
    quantization_config the data plane does not serve (bitsandbytes) is refused by name."""
    config: dict[str, object] = {
        "model_type": "qwen2", "num_hidden_layers": 80, "hidden_size": 8192,
        "intermediate_size": 29568, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 152064, "max_position_embeddings": 32768,
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64},
    }  # fmt: skip
    gptq = tmp_path / "gptq-64"
    gptq.mkdir()
    (gptq / "config.json").write_text(json.dumps(config))
    base = ["plan", "--model", str(gptq), "--gpu", "h200", "--adapters", "100", "--json"]
    assert main([*base, "--recommend-layout"]) == 0
    layouts = {item["layout"]: item for item in json.loads(capsys.readouterr().out)["layouts"]}
    assert layouts["int4, TP=2"]["fits"]
    assert "groups of 64 inputs do not split over 4 GPUs" in layouts["int4, TP=4"]["why_not"]
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (gptq / "config.json").write_text(json.dumps(config))
    assert main(base) == 2
    assert "its quantization_config is a form the data plane does not serve" in (
        capsys.readouterr().err
    )


def test_a_block_fp8_moe_is_planned_over_splits_that_cut_its_scale_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-30B-A3B-FP8 (transformers' block-wise "fp8", blocks of 128x128): an expert's 768
    rows leave 384 per GPU over 2 (whole blocks) and 192 over 4 (not: vLLM refused it), which
    the data plane serves (a rank keeps the blocks it touches); planned in FP8 as stored."""
    config: dict[str, object] = {
        "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "vocab_size": 151936, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }  # fmt: skip
    folder = tmp_path / "qwen3-30b-a3b-fp8"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    base = ["plan", "--model", str(folder), "--gpu", "h100", "--adapters", "10", "--json"]
    weights = {}
    for size in (1, 2, 4):
        assert main([*base, "--tensor-parallel-size", str(size)]) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        assert out["quantization"] == "fp8"
        weights[size] = out["memory"]["weights_bytes"]
    assert weights[1] > weights[2] > weights[4]


def test_a_block_fp8_checkpoint_is_sized_with_a_scale_per_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Llama-3-8B's shape, FP8 per channel against blocks of 128x128: the same bytes of
    weights, an fp32 factor per block (13,312 a layer) instead of per row (43,008 a layer)."""
    channel = _checkpoint(tmp_path, "channel", {"quant_method": "compressed-tensors",
                                                "format": "float-quantized"})  # fmt: skip
    block = _checkpoint(tmp_path, "block", {"quant_method": "fp8", "fmt": "e4m3",
                                            "weight_block_size": [128, 128]})  # fmt: skip
    weights = {}
    for folder in (channel, block):
        args = ["plan", "--model", str(folder), "--gpu", "h100", "--adapters", "10", "--json"]
        assert main(args) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        assert out["quantization"] == "fp8"
        weights[folder.name] = out["memory"]["weights_bytes"]
    assert weights["channel"] - weights["block"] == 32 * 4 * (43008 - 13312)
