"""Block-wise FP8 checkpoints (models/quant.py, issue 31): transformers' quant_method "fp8", the
layout of Qwen's and DeepSeek's own FP8 releases: each projection's float8 e4m3 `weight` with a
`weight_scale_inv` of one fp32 factor per block of `weight_block_size` (multiplied); and
llm-compressor's FP8 block scheme (compressed-tensors strategy "block", `block_structure`, the
factors in `weight_scale`).

The checkpoints are written here from the tiny Llama by the tests' own block quantizer (amax /
448 per block, partial blocks at the edges included), beside the same weights dequantized in
fp32: HF + PEFT on those is the reference, greedy tokens exactly, adapters mixed with the base.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplane.adapters.base_model import (
    BaseModelSpec,
    checkpoint_quantization,
    fp8_block,
    fp8_block_split_problem,
)
from loraplane.dataplane.engine_setup import describe
from loraplane.dataplane.models import UnsupportedModelError, load_model
from loraplane.dataplane.models.quant import FP8, FP8_MAX, PROJECTION, FP8Linear, scheme_for
from loraplane.dataplane.parallel.shard import TPShard
from tests.dataplane.conftest import Family
from tests.dataplane.test_engine import hf_greedy, prompts
from tests.dataplane.test_quant_fp8 import _engine, _mixed, _peft

BLOCKS = [(32, 32), (48, 40)]  # whole blocks; partial ones at the end of rows and columns


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """(W8, scale [ceil(out / rows), ceil(in / cols)], dequantized) of `weight` [out, in]."""
    rows, cols = block
    out, inputs = weight.shape
    scale = torch.empty(-(-out // rows), -(-inputs // cols))
    w8 = torch.empty(out, inputs, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = weight[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].float()
            s = (part.abs().amax() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
            scale[i, j] = s
            w8[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = (part / s).to(FP8)
    spread = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inputs]
    return w8, scale, w8.float() * spread


def _config(block: tuple[int, int], layout: str) -> dict[str, Any]:
    if layout == "transformers":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}  # fmt: skip
    weights = {"num_bits": 8, "type": "float", "strategy": "block",
               "block_structure": list(block), "symmetric": True, "dynamic": False}  # fmt: skip
    activations = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                   "symmetric": True, "dynamic": True}  # fmt: skip
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"], "config_groups": {"group_0": group}}  # fmt: skip


def write_block_fp8(
    src: Path, out: Path, block: tuple[int, int], layout: str = "transformers"
) -> tuple[Path, Path]:
    """(the block-wise FP8 checkpoint, the same weights dequantized in fp32) of `src`, in
    transformers' layout (`weight_scale_inv`) or compressed-tensors' (`weight_scale`)."""
    tag = f"{layout}-{block[0]}x{block[1]}"
    fp8, plain = out / f"fp8-block-{tag}", out / f"plain-{tag}"
    scale_name = "weight_scale_inv" if layout == "transformers" else "weight_scale"
    for folder in (fp8, plain):
        shutil.copytree(src, folder)
        (folder / "model.safetensors").unlink()
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and PROJECTION.match(module):
            quantized[name], quantized[f"{module}.{scale_name}"], dequantized[name] = (
                quantize_blocks(tensor, block)
            )
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, fp8 / "model.safetensors")
    save_file(dequantized, plain / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config(block, layout)
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, plain


@pytest.fixture(scope="module")
def block_checkpoints(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[int, int], tuple[Path, Path]]:
    out = tmp_path_factory.mktemp("fp8-block")
    return {b: write_block_fp8(tiny_llama_dir, out, b) for b in [*BLOCKS, (16, 16)]}


@pytest.mark.parametrize(
    ("block", "layout"),
    [((32, 32), "transformers"), ((48, 40), "transformers"), ((48, 40), "compressed-tensors")],
)
def test_a_block_fp8_checkpoint_serves_mixed_adapters_as_hf_peft_on_its_dequantized_weights(
    block: tuple[int, int],
    layout: str,
    block_checkpoints: dict[tuple[int, int], tuple[Path, Path]],
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    tmp_path: Path,
) -> None:
    if layout == "transformers":
        fp8, plain = block_checkpoints[block]
    else:
        fp8, plain = write_block_fp8(tiny_llama_dir, tmp_path, block, layout)
    config = json.loads((fp8 / "config.json").read_text())
    assert checkpoint_quantization(config) == "fp8"
    assert fp8_block(config["quantization_config"]) == block
    engine = _engine(fp8)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 2 * 7 and all(m.block == block for m in layers)
    # what `serve` logs at start names the form
    assert (f"(projections 14 in fp8 e4m3 per block of {block[0]}x{block[1]}, the rest float32)"
            in describe(engine))  # fmt: skip
    assert all(m.weight.dtype == FP8 and m.weight_scale.dim() == 2 for m in layers)
    got, names = _mixed(engine, peft_adapters)
    reference = _peft(plain, peft_adapters)
    for prompt, name, tokens in zip(prompts(len(names), seed=7), names, got, strict=True):
        assert tokens == hf_greedy(reference, prompt, name, 12), (block, name)


@pytest.mark.parametrize("block", [(16, 16), (48, 40)])
def test_each_rank_holds_the_scale_blocks_of_its_slice_and_tp2_gives_tp1s_tokens(
    block: tuple[int, int],
    block_checkpoints: dict[tuple[int, int], tuple[Path, Path]],
    peft_adapters: dict[str, Path],
) -> None:
    """Blocks of 16x16 split whole; blocks of 48x40 do not: q_proj's 64 rows leave rank 1 rows
    32-63, which start 32 rows into block 0 (a split vLLM refused for Qwen3-30B-A3B-FP8 at TP =
    4): each rank keeps the blocks it touches and reads them from its offset."""
    from tests.dataplane.test_tensor_parallel import _split_equals_whole

    fp8 = block_checkpoints[block][0]
    whole = load_model(fp8, torch.float32, "cpu")
    ranks = [load_model(fp8, torch.float32, "cpu", shard=TPShard(r, 2)) for r in range(2)]
    offsets = set()
    for name, full in whole.named_modules():
        if not isinstance(full, FP8Linear):
            continue
        parts = [rank.get_submodule(name) for rank in ranks]
        offsets |= {p.block_offset for p in parts}  # type: ignore[misc]
        weights = [p.dequantized() for p in parts]  # type: ignore[operator]
        axis = 1 if name.endswith(("o_proj", "down_proj")) else 0  # input columns, output rows
        torch.testing.assert_close(torch.cat(weights, axis), full.dequantized(), rtol=0, atol=0)
    assert (offsets == {(0, 0)}) == (block == (16, 16))  # 48x40: slices start inside blocks
    names: list[str | None] = ["r4", "r16", None, "r32-mlp", "r8-patterns", "r4"]
    _split_equals_whole(Family("llama", fp8, peft_adapters), names)


def test_a_fused_projection_whose_parts_would_cut_scale_blocks_is_refused_naming_them(
    tmp_path: Path,
) -> None:
    """Phi-3's qkv_proj: a rank's q, k and v rows are three runs of one layer, which must each
    be whole blocks (its q rows: 32 a rank at TP = 2, not blocks of 48)."""
    from tests.factories import build_model

    fp8 = write_block_fp8(build_model(tmp_path / "phi3", "phi3"), tmp_path, (48, 40))[0]
    with pytest.raises(UnsupportedModelError, match=r"tensor parallel size 2: FP8 weights in"
                       r" blocks of 48x40 do not split over 2 GPUs: qkv_proj's q rows come"
                       r" to 32 per GPU, not whole blocks of 48"):  # fmt: skip
        load_model(fp8, torch.float32, "cpu", shard=TPShard(0, 2))
    load_model(fp8, torch.float32, "cpu")  # unsplit: served
    qwen3_moe = BaseModelSpec("m", "qwen3_moe", 48, 2048, 6144, 32, 4, 128, 128, 768, (0, 1))
    for size in (2, 4, 8):  # Qwen3-30B-A3B-FP8: its experts' 768 rows leave 96 at TP = 8
        assert fp8_block_split_problem(qwen3_moe, size, (128, 128)) is None


def _rewrite(src: Path, out: Path, config: dict[str, Any] | None = None,
             scales: str | None = None) -> Path:  # fmt: skip
    shutil.copytree(src, out)
    if config is not None:
        body = json.loads((out / "config.json").read_text())
        body["quantization_config"].update(config)
        (out / "config.json").write_text(json.dumps(body))
    if scales is not None:
        tensors = load_file(out / "model.safetensors")
        key = next(k for k in tensors if k.endswith("q_proj.weight_scale_inv"))
        narrow = tensors[key][:, :1].contiguous()
        tensors[key] = narrow if scales == "narrow" else tensors[key].reshape(-1)
        save_file(tensors, out / "model.safetensors")
    return out


def test_what_a_block_fp8_checkpoint_may_not_say_is_refused_by_name(
    block_checkpoints: dict[tuple[int, int], tuple[Path, Path]], tmp_path: Path
) -> None:
    fp8 = block_checkpoints[(32, 32)][0]
    for i, (change, message) in enumerate([
        ({"fmt": "e5m2"}, "fp8 weights in format 'e5m2' are not supported"),
        ({"weight_block_size": None}, "weight_block_size None must be two positive ints"),
        ({"weight_block_size": [128]}, "weight_block_size [128] must be two positive ints"),
    ]):  # fmt: skip
        with pytest.raises(UnsupportedModelError, match=re.escape(message)):
            load_model(_rewrite(fp8, tmp_path / f"c{i}", config=change), torch.float32, "cpu")
    flat = r"q_proj.weight_scale_inv has shape \(4,\): block-wise FP8 keeps one factor per block"
    with pytest.raises(ValueError, match=flat):
        load_model(_rewrite(fp8, tmp_path / "flat", scales="flat"), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"does not fit its config\.json"):
        load_model(_rewrite(fp8, tmp_path / "narrow", scales="narrow"), torch.float32, "cpu")
    # compressed-tensors: a block strategy without its block, and transformers' scale name
    ct = _config((32, 32), "compressed-tensors")
    del ct["config_groups"]["group_0"]["weights"]["block_structure"]
    with pytest.raises(UnsupportedModelError, match="FP8 weights per block need block_structure"):
        scheme_for({"quantization_config": ct}, None)
    renamed = _rewrite(fp8, tmp_path / "ct", config=_config((32, 32), "compressed-tensors"))
    body = json.loads((renamed / "config.json").read_text())
    body["quantization_config"] = _config((32, 32), "compressed-tensors")
    (renamed / "config.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(\d, \d\): block-wise"
                       r" FP8 keeps one factor per block of 32x32 in `weight_scale`"):  # fmt: skip
        load_model(renamed, torch.float32, "cpu")
