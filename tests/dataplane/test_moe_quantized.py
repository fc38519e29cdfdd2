"""Quantized weights of a mixture of experts (issue 31): Mixtral and Qwen3-MoE checkpoints in FP8,
in the layout llm-compressor writes (every expert's linears and the attention projections in
float8 e4m3 with their scales, the routers and lm_head 16-bit), block-wise FP8 as Qwen's own
releases store it, a 16-bit one quantized at load, and 4-bit checkpoints (AutoAWQ, GPTQ v2 per
channel) whose experts are 4-bit too.

The reference is transformers + PEFT on the same weights dequantized, fp32, with adapters on
attention and on the experts (PEFT target_parameters): the engine's greedy tokens must be its
greedy tokens exactly, in mixed batches with base rows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplane.dataplane.engine import Engine
from loraplane.dataplane.models import UnsupportedModelError, load_model
from loraplane.dataplane.models.moe import SparseMoeBlock
from loraplane.dataplane.models.quant import FP8Linear, quantize
from loraplane.dataplane.models.quant_w4 import W4Linear
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.conftest import Family
from tests.dataplane.test_dora import engine_for
from tests.dataplane.test_models_moe_parity import (
    KINDS,
    _prompt,
    _reference_logits,
    moe_families,  # noqa: F401 - a fixture this module's tests take
)
from tests.dataplane.test_quant_fp8 import _write
from tests.dataplane.test_quant_fp8_block import write_block_fp8
from tests.dataplane.w4_checkpoints import write as write_w4

# Mixtral's checkpoint per channel, Qwen3-MoE's per tensor
STRATEGY = {"mixtral": "channel", "qwen3_moe": "tensor"}
# 4-bit: Mixtral's in AutoAWQ's groups of 32, Qwen3-MoE's (experts of 48 inputs) per channel
W4_VARIANT = {"mixtral": "awq", "qwen3_moe": "gptq-v2"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8_moe(
    moe_families: dict[str, Family],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, Path]]:
    """kind -> (its FP8 checkpoint, the same weights dequantized in fp32)."""
    out = tmp_path_factory.mktemp("fp8-moe")
    return {k: _write(moe_families[k].model_dir, out / k, STRATEGY[k]) for k in KINDS}


def _engine(model: Path, **overrides: Any) -> Engine:
    return engine_for(model, max_loras=3, max_num_batched_tokens=24, **overrides)


def _generate(
    engine: Engine, adapters: dict[str, Path], kind: str
) -> tuple[list[list[int]], list[list[int]], list[str | None]]:
    """(prompts, greedy tokens, adapter names): every adapter and base rows in one batch."""
    refs = {name: engine.register_lora(name, path, "t") for name, path in adapters.items()}
    names: list[str | None] = [*adapters, None, "r16-experts"]
    rng = random.Random(f"fp8-{kind}")
    batch = [_prompt(rng, rng.randint(5, 18)) for _ in names]
    outs = engine.generate(batch, GREEDY, [refs[n] if n else None for n in names])
    assert all(o.error is None for o in outs)
    return batch, [o.token_ids for o in outs], names


def _hf_peft(model_dir: Path, adapters: dict[str, Path]) -> Callable[[str | None], Any]:
    """adapter -> HF on `model_dir` (None) or a PeftModel with that adapter (fp32)."""
    import peft
    import transformers

    cache: dict[str | None, Any] = {}

    def get(adapter: str | None) -> Any:
        if adapter not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
            if adapter is not None:
                model = peft.PeftModel.from_pretrained(model, adapters[adapter])
            cache[adapter] = model.eval()
        return cache[adapter]

    return get


@pytest.mark.parametrize("form", ["fp8", "fp8-block", "int4"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_moe_checkpoint_serves_expert_adapters_as_hf_peft_on_its_dequantized_weights(
    kind: str,
    form: str,
    moe_families: dict[str, Family],  # noqa: F811
    fp8_moe: dict[str, tuple[Path, Path]],
    tmp_path: Path,
) -> None:
    if form == "fp8":
        checkpoint, plain = fp8_moe[kind]
    elif form == "fp8-block":  # as Qwen's own FP8 releases: a scale per block of 16x16 here
        checkpoint, plain = write_block_fp8(moe_families[kind].model_dir, tmp_path, (16, 16))
    else:
        written = write_w4(moe_families[kind].model_dir, tmp_path, W4_VARIANT[kind])
        checkpoint, plain = written.w4, written.plain
    engine = _engine(checkpoint)
    model = engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    layer = W4Linear if form == "int4" else FP8Linear
    for block in blocks:  # every expert's linears quantized, the router 16-bit
        linears = [linear for expert in block.expert_list for linear in expert.linears()]
        assert len(linears) == 3 * block.num_experts
        assert all(isinstance(x, layer) for x in linears)
        assert type(block.gate) is torch.nn.Linear
    adapters = moe_families[kind].adapters
    batch, got, names = _generate(engine, adapters, kind)
    reference = _hf_peft(plain, adapters)
    for prompt, name, tokens in zip(batch, names, got, strict=True):
        expected = list(prompt)
        for _ in range(GREEDY.max_tokens):
            expected.append(int(_reference_logits(reference(name), expected)[-1].argmax()))
        assert tokens == expected[len(prompt) :], (kind, name)


def test_fp8_at_load_quantizes_a_moe_as_its_per_channel_checkpoint(
    moe_families: dict[str, Family],  # noqa: F811
    fp8_moe: dict[str, tuple[Path, Path]],
) -> None:
    """`quantization="fp8"` on Mixtral's 16-bit checkpoint gives the per-channel FP8
    checkpoint's experts bit for bit, and its tokens."""
    bf = moe_families["mixtral"].model_dir
    at_load = load_model(bf, torch.float32, "cpu", quantization="fp8")
    stored = load_model(fp8_moe["mixtral"][0], torch.float32, "cpu")
    quantized = [n for n, m in at_load.named_modules() if isinstance(m, FP8Linear)]
    assert any(".experts.3.w2" in n for n in quantized)
    assert not any(n.endswith("block_sparse_moe.gate") for n in quantized)
    for name in quantized:
        a, b = at_load.get_submodule(name), stored.get_submodule(name)
        assert isinstance(b, FP8Linear), name
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)), name
        assert torch.equal(a.weight_scale, b.weight_scale), name
    adapters = moe_families["mixtral"].adapters
    _, expected, _ = _generate(_engine(fp8_moe["mixtral"][0]), adapters, "mixtral")
    _, got, _ = _generate(_engine(bf, quantization="fp8"), adapters, "mixtral")
    assert got == expected


def test_an_fp8_router_is_refused_naming_it(
    moe_families: dict[str, Family],  # noqa: F811
    tmp_path: Path,
) -> None:
    """A checkpoint that quantized a router (not in its ignore list) would lose the router's
    scale if cast as a 16-bit weight: it is refused by name."""
    src = moe_families["qwen3_moe"].model_dir
    fp8, _ = _write(src, tmp_path, "channel")
    tensors = load_file(fp8 / "model.safetensors")
    router = "model.layers.0.mlp.gate"
    tensors[f"{router}.weight"], tensors[f"{router}.weight_scale"] = quantize(
        tensors[f"{router}.weight"], per_channel=True
    )
    save_file(tensors, fp8 / "model.safetensors")
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    with pytest.raises(UnsupportedModelError, match=rf"{router}\.weight is stored in FP8"):
        load_model(fp8, torch.float32, "cpu")
