"""4-bit base weights (models/quant_w4.py, models/w4_formats.py; issue 31): compressed-tensors
pack-quantized, AWQ and GPTQ checkpoints, served with LoRA adapters in mixed batches.

The checkpoints are written by the tests' own quantizer and packers (w4_checkpoints.py) from the
tiny Llama; the reference is transformers + PEFT on the same weights dequantized to fp32, which
the engine, in fp32 on CPU, must follow token for token and in log-probabilities.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.engine_setup import describe
from loraplane.dataplane.lora.layers import LinearWithLoRA
from loraplane.dataplane.lora.metadata import LoRABatch
from loraplane.dataplane.models import UnsupportedModelError, w4_formats
from loraplane.dataplane.models.loader import load_model
from loraplane.dataplane.models.quant import PROJECTION
from loraplane.dataplane.models.quant_w4 import W4Linear
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.conftest import hf_logits
from tests.dataplane.test_engine import hf_greedy, prompts
from tests.dataplane.w4_checkpoints import VARIANTS, Checkpoint, quantization_config, write

ADAPTERS = ("r16", "r32-mlp")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def checkpoints(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Checkpoint]:
    out = tmp_path_factory.mktemp("w4")
    return {name: write(tiny_llama_dir, out, name) for name in VARIANTS}


def _engine(model: Path, **overrides: Any) -> Engine:
    settings: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                                "num_kv_blocks": 128, "max_num_seqs": 8}  # fmt: skip
    settings.update(overrides)
    return Engine(EngineConfig(model=str(model), **settings))


def _w4_layers(model: torch.nn.Module) -> dict[str, W4Linear]:
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, W4Linear):  # under a LoRA wrapper once installed
            found[name.removesuffix(".base_layer")] = module
    return found


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_formats_projections_dequantize_to_the_tests_own_dequantization(
    variant: str, checkpoints: dict[str, Checkpoint], tiny_llama_dir: Path
) -> None:
    """Every projection read from the checkpoint is, dequantized, bit for bit the weight the
    tests' quantizer meant; it holds half a byte per weight, plus a scale (and a zero byte)
    per group of each row, and the act-order map."""
    ckpt = checkpoints[variant]
    model = load_model(ckpt.w4, torch.float32, "cpu")
    layers = _w4_layers(model)
    assert sorted(layers) == sorted(ckpt.layers) and len(layers) == 2 * 7
    for name, layer in layers.items():
        assert layer.qweight.dtype == torch.int32
        assert layer.qweight.shape == (layer.out_features, layer.in_features // 8)
        assert torch.equal(layer.dequantized(), ckpt.layers[name].dequantized()), name
        assert (layer.g_idx is not None) == VARIANTS[variant].act_order
    assert model.lm_head.weight.dtype == torch.float32  # not quantized
    v = VARIANTS[variant]
    scale_bytes = torch.empty(0, dtype=v.scale_dtype).element_size()
    zero_bytes = 0 if v.format == "pack-quantized" and v.symmetric else 1  # GPTQ stores them
    for layer in layers.values():
        n, k = layer.out_features, layer.in_features
        groups = 1 if v.group_size == -1 else k // v.group_size
        held = n * k // 2 + n * groups * (scale_bytes + zero_bytes)
        assert layer.device_bytes() == held + (4 * k if v.act_order else 0)
    if v.group_size == 32 and not v.act_order:  # half a byte a weight, plus the groups'
        w4 = sum(layer.device_bytes() for layer in layers.values())
        params = sum(layer.in_features * layer.out_features for layer in layers.values())
        assert 0.5 < w4 / params < 0.6, w4 / params


def test_misreading_the_packing_order_or_gptq_v1_zeros_is_caught(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative controls for the test above: AWQ's nibbles read in plain order, and GPTQ v1's
    zeros read without their + 1, give other weights."""
    name = "model.layers.0.self_attn.q_proj"
    v1 = checkpoints["gptq"]
    as_v2 = tmp_path / "as-v2"
    shutil.copytree(v1.w4, as_v2)
    config = json.loads((as_v2 / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (as_v2 / "config.json").write_text(json.dumps(config))
    layer = _w4_layers(load_model(as_v2, torch.float32, "cpu"))[name]
    assert not torch.equal(layer.dequantized(), v1.layers[name].dequantized())
    monkeypatch.setattr(w4_formats, "_AWQ_COLUMNS", tuple(range(8)))
    layer = _w4_layers(load_model(checkpoints["awq"].w4, torch.float32, "cpu"))[name]
    assert not torch.equal(layer.dequantized(), checkpoints["awq"].layers[name].dequantized())


def _peft(model: Path, adapters: dict[str, Path]) -> torch.nn.Module:
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    first, *rest = ADAPTERS
    lora = peft.PeftModel.from_pretrained(base, adapters[first], adapter_name=first)
    for name in rest:
        lora.load_adapter(adapters[name], adapter_name=name)
    return lora.eval()


@pytest.mark.parametrize("variant", ["ct-asym", "awq", "gptq", "gptq-act-order"])
def test_a_4_bit_checkpoint_serves_mixed_adapters_as_hf_peft_on_its_dequantized_weights(
    variant: str, checkpoints: dict[str, Checkpoint], peft_adapters: dict[str, Path]
) -> None:
    """A mixed batch of two adapters and base rows: the greedy tokens are HF + PEFT's on the
    dequantized fp32 checkpoint, and so (to 1e-4) are the chosen tokens' log-probabilities."""
    ckpt = checkpoints[variant]
    engine = _engine(ckpt.w4)
    assert len(_w4_layers(engine.runner.model)) == 14
    size = VARIANTS[variant].group_size  # what `serve` logs at start names the form
    groups = "one group per row" if size == -1 else f"groups of {size}"
    assert f"(projections 14 in 4-bit, {groups}, the rest float32)" in describe(engine)
    names: list[str | None] = [*ADAPTERS, None, "r16", None]
    refs = {n: engine.register_lora(n, peft_adapters[n], "t") for n in ADAPTERS}
    batch = prompts(len(names), seed=7)
    outs = engine.generate(batch, GREEDY, [refs[n] if n else None for n in names])
    reference = _peft(ckpt.plain, peft_adapters)
    for prompt, name, out in zip(batch, names, outs, strict=True):
        assert out.error is None and out.logprobs is not None
        tokens, logprobs = list(prompt), []
        for _ in range(GREEDY.max_tokens):
            scores = torch.log_softmax(hf_logits(reference, tokens, name)[-1], dim=-1)
            tokens.append(int(scores.argmax()))
            logprobs.append(float(scores.max()))
        assert out.token_ids == tokens[len(prompt) :], (variant, name)
        torch.testing.assert_close(
            torch.tensor(out.logprobs), torch.tensor(logprobs), rtol=0, atol=1e-4
        )


def test_an_awq_qwen2_with_q_k_v_biases_serves_as_hf_peft_on_its_dequantized_weights(
    tmp_path: Path,
) -> None:
    """AWQ checkpoints of Qwen2 keep the q/k/v biases beside the 4-bit weights (tied
    embeddings, no lm_head tensor): read into the layer's bias, they reach the output."""
    import peft
    import transformers

    from tests.dataplane.conftest import _perturb
    from tests.factories import build_model, build_peft_adapter

    src = build_model(tmp_path / "qwen2", "qwen2")
    _perturb(src, seed=7)  # biases drawn, not HF's zeros
    adapter = build_peft_adapter(src, tmp_path / "r8", seed=1, r=8, lora_alpha=16)
    ckpt = write(src, tmp_path, "awq")
    engine = _engine(ckpt.w4)
    layers = _w4_layers(engine.runner.model)
    q_proj = layers["model.layers.0.self_attn.q_proj"]
    assert q_proj.bias is not None and q_proj.bias.abs().max() > 0
    ref = engine.register_lora("r8", adapter, "t")
    batch = prompts(2, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = engine.generate(batch, params, [ref, None])
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt.plain, dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, adapter, adapter_name="r8").eval()
    for prompt, name, out in zip(batch, ["r8", None], outs, strict=True):
        assert out.token_ids == hf_greedy(reference, prompt, name, 8), name


def test_the_lora_delta_over_a_4_bit_base_is_the_delta_over_the_unquantized_base(
    tiny_llama_dir: Path, checkpoints: dict[str, Checkpoint], peft_adapters: dict[str, Path]
) -> None:
    """LoRA reads the unquantized activations: on the same input, (LoRA layer - its base) is
    the same over an AWQ base as over the fp32 one (the issue's 1e-3 relative)."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    deltas = []
    for model in (tiny_llama_dir, checkpoints["awq"].w4):
        engine = _engine(model)
        ref = engine.register_lora("r16", peft_adapters["r16"], "t")
        engine.generate([[5, 6, 7]], GREEDY, [ref])  # the adapter into its slot
        layer = engine.runner.model.get_submodule("model.layers.1.self_attn.q_proj")
        assert isinstance(layer, LinearWithLoRA)
        slot = engine.loras.slot_of(ref.key)
        assert layer.context is not None
        layer.context.activate(LoRABatch.from_token_slots([slot] * 5))
        with torch.no_grad():
            deltas.append(layer(x) - layer.base_layer(x))
        layer.context.activate(None)
    assert isinstance(layer.base_layer, W4Linear)  # the second one is the 4-bit base
    assert deltas[0].abs().max() > 0
    torch.testing.assert_close(deltas[1], deltas[0], rtol=1e-3, atol=1e-6)


def test_a_seeded_sampled_request_on_a_4_bit_base_is_the_same_run_to_run(
    checkpoints: dict[str, Checkpoint], peft_adapters: dict[str, Path]
) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = _engine(checkpoints["gptq"].w4)
        ref = engine.register_lora("r16", peft_adapters["r16"], "t")
        (out,) = engine.generate([[9, 8, 7, 6]], params, [ref])
        runs.append(out.token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 10


def _with_config(src: Path, out: Path, quantization_config: Any) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(
        json.dumps({**config, "quantization_config": quantization_config})
    )
    return out


def _ct(**weights: Any) -> dict[str, Any]:
    config = quantization_config(VARIANTS["ct-sym"])
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**quantization_config(VARIANTS["gptq"]), "bits": 8},
         "quantization_config.bits 8 is not supported; supported: 4"),
        ({**quantization_config(VARIANTS["awq"]), "bits": 3}, "bits 3 is not supported"),
        (_ct(num_bits=8), "num_bits 8, type 'int' are not supported"),
        (_ct(type="float", num_bits=4), "num_bits 4, type 'float' are not supported"),
        (_ct(strategy="tensor"), "strategy 'tensor' are not supported"),
        (_ct(group_size=12), "weights.group_size 12 is not a multiple of 8"),
        ({**quantization_config(VARIANTS["gptq"]), "checkpoint_format": "marlin"},
         "checkpoint_format 'marlin' is not supported"),
        ({**quantization_config(VARIANTS["awq"]), "version": "gemv"},
         "AWQ version 'gemv' is not supported"),
        ({**quantization_config(VARIANTS["awq"]), "zero_point": False}, "AWQ zero_point False"),
        ({**quantization_config(VARIANTS["ct-sym"]), "format": "marlin-24"},
         "format 'marlin-24' is not supported"),
        ({**quantization_config(VARIANTS["awq"]), "quant_method": "bitsandbytes"},
         "quant_method 'bitsandbytes' is not supported"),
        ({**quantization_config(VARIANTS["ct-sym"]),
          "sparsity_config": {"format": "sparse-24-bitmask"}},
         "sparsity_config .* is not supported"),
    ],
)  # fmt: skip
def test_a_4_bit_scheme_the_engine_cannot_serve_is_refused_naming_its_field(
    tiny_llama_dir: Path, tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(_with_config(tiny_llama_dir, tmp_path / "m", config), torch.float32, "cpu")


def test_activation_quantization_fp8_at_load_and_a_shuffled_g_idx_without_act_order_are_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    w4a8 = quantization_config(VARIANTS["ct-sym"])
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(UnsupportedModelError, match="input_activations are quantized"):
        load_model(_with_config(checkpoints["ct-sym"].plain, tmp_path / "a", w4a8),
                   torch.float32, "cpu")  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"already quantized \(awq, 4-bit\)"):
        load_model(checkpoints["awq"].w4, torch.float32, "cpu", quantization="fp8")
    # an act-order checkpoint whose config says desc_act false: its g_idx is not the identity
    lying = tmp_path / "g"
    shutil.copytree(checkpoints["gptq-act-order"].w4, lying)
    config = json.loads((lying / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (lying / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="g_idx is not in column order"):
        load_model(lying, torch.float32, "cpu")


def test_a_16_bit_weight_under_a_4_bit_config_is_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """The fp32 checkpoint under an AWQ config: its `weight` tensors are not what it claims."""
    model = _with_config(checkpoints["awq"].plain, tmp_path / "m",
                         quantization_config(VARIANTS["awq"]))  # fmt: skip
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.0\..*\.weight"):
        load_model(model, torch.float32, "cpu")
    # and a packed weight that is not int32
    bad = tmp_path / "b"
    shutil.copytree(checkpoints["gptq"].w4, bad)
    tensors = load_file(bad / "model.safetensors")
    name = next(k for k in tensors if k.endswith("q_proj.qweight") and PROJECTION.match(k[:-8]))
    tensors[name] = tensors[name].to(torch.int64)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="a packed 4-bit tensor is int32"):
        load_model(bad, torch.float32, "cpu")
