"""The planner's presets of the new families (Qwen3, Qwen3-30B-A3B, Gemma 3, Phi-4, Mixtral):
parameter counts within 2% of the published totals (total and active for the mixtures of
experts), KV bytes per token exactly as the configs give them, the same numbers read from a
config.json that transformers writes for each, adapter sizes per family (fused layers once,
every expert), and `loraplane plan --model DIR` for any supported family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loraplane.cli import main
from loraplane.planner.memory import AdapterProfile, adapter_elements, kv_bytes_per_token
from loraplane.planner.shapes import ModelShape, named_shape

transformers = pytest.importorskip("transformers")

# Published totals (model cards; Gemma 3's technical report, table 1: embedding + non-embedding
# parameters of the text stack, the 417M vision encoder left out; Mistral's Mixtral release)
PUBLISHED = {
    "qwen3-8b": 8.2e9,
    "qwen3-32b": 32.8e9,
    "qwen3-30b-a3b": 30.5e9,
    "gemma-3-12b": 1_012e6 + 10_759e6,
    "gemma-3-27b": 1_416e6 + 25_600e6,
    "phi-4": 14.7e9,
    "mixtral-8x7b": 46.7e9,
}
ACTIVE = {"qwen3-30b-a3b": 3.3e9, "mixtral-8x7b": 12.9e9}
# 2 (K and V) x layers x KV heads x head_dim x 2 bytes (bfloat16), from each config.json
KV_PER_TOKEN = {
    "qwen3-8b": 2 * 36 * 8 * 128 * 2,
    "qwen3-32b": 2 * 64 * 8 * 128 * 2,
    "qwen3-30b-a3b": 2 * 48 * 4 * 128 * 2,
    "gemma-3-12b": 2 * 48 * 8 * 256 * 2,
    "gemma-3-27b": 2 * 62 * 16 * 128 * 2,
    "phi-4": 2 * 40 * 10 * 128 * 2,
    "mixtral-8x7b": 2 * 32 * 8 * 128 * 2,
}

# The published config.json numbers, through transformers' own config classes
_GEMMA3 = {"rope_parameters": None, "sliding_window": 1024}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-8b": ("Qwen3Config", {"hidden_size": 4096, "intermediate_size": 12288,
                                 "num_hidden_layers": 36, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "head_dim": 128,
                                 "vocab_size": 151936, "max_position_embeddings": 40960,
                                 "tie_word_embeddings": False}),
    "qwen3-32b": ("Qwen3Config", {"hidden_size": 5120, "intermediate_size": 25600,
                                  "num_hidden_layers": 64, "num_attention_heads": 64,
                                  "num_key_value_heads": 8, "head_dim": 128,
                                  "vocab_size": 151936, "max_position_embeddings": 40960,
                                  "tie_word_embeddings": False}),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", {"hidden_size": 2048, "intermediate_size": 6144,
                                         "moe_intermediate_size": 768, "num_experts": 128,
                                         "num_experts_per_tok": 8, "num_hidden_layers": 48,
                                         "num_attention_heads": 32, "num_key_value_heads": 4,
                                         "head_dim": 128, "vocab_size": 151936,
                                         "max_position_embeddings": 40960,
                                         "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "phi-4": ("Phi3Config", {"hidden_size": 5120, "intermediate_size": 17920,
                             "num_hidden_layers": 40, "num_attention_heads": 40,
                             "num_key_value_heads": 10, "vocab_size": 100352,
                             "max_position_embeddings": 16384, "pad_token_id": 100349}),
    "mixtral-8x7b": ("MixtralConfig", {"hidden_size": 4096, "intermediate_size": 14336,
                                       "num_hidden_layers": 32, "num_attention_heads": 32,
                                       "num_key_value_heads": 8, "num_local_experts": 8,
                                       "num_experts_per_tok": 2, "vocab_size": 32000,
                                       "max_position_embeddings": 32768}),
}  # fmt: skip
GEMMA3_TEXT = {
    "gemma-3-12b": {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256},
    "gemma-3-27b": {"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128},
}  # fmt: skip


def _config_dir(root: Path, name: str) -> Path:
    out = root / name
    if name in GEMMA3_TEXT:
        text = {**GEMMA3_TEXT[name], "vocab_size": 262208, "max_position_embeddings": 131072}
        config = transformers.Gemma3Config(text_config=text)
    else:
        cls, fields = CONFIGS[name]
        config = getattr(transformers, cls)(**fields)
    config.save_pretrained(out)
    return out


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_counts_are_within_2_percent_of_the_published_totals(name: str) -> None:
    shape = named_shape(name)
    assert shape.num_params() == pytest.approx(PUBLISHED[name], rel=0.02)
    if name in ACTIVE:
        assert shape.active_params() == pytest.approx(ACTIVE[name], rel=0.02)
        assert shape.active_params() < shape.num_params() / 3
    else:
        assert shape.active_params() == shape.num_params()


@pytest.mark.parametrize("name", list(KV_PER_TOKEN))
def test_kv_bytes_per_token_are_exactly_the_configs(name: str) -> None:
    assert kv_bytes_per_token(named_shape(name), "bfloat16") == KV_PER_TOKEN[name]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_a_config_json_of_the_same_model_reads_as_the_preset(name: str, tmp_path: Path) -> None:
    """What `--model DIR` reads from the config.json transformers writes for that model gives
    the preset's numbers (parameters, KV, adapter sizes)."""
    shape = ModelShape.from_dir(str(_config_dir(tmp_path, name)))
    preset = named_shape(name)
    assert shape.model_type == preset.model_type
    assert shape.num_params() == preset.num_params()
    assert shape.active_params() == preset.active_params()
    assert kv_bytes_per_token(shape, "bfloat16") == KV_PER_TOKEN[name]
    profile = AdapterProfile(1, 16)
    assert adapter_elements(shape, profile) == adapter_elements(preset, profile)


def test_adapter_sizes_follow_each_familys_layers() -> None:
    all_roles = AdapterProfile(1, 16)
    # Phi-4: q/k/v adapt one qkv_proj (in 5120, out 5120 + 2 * 1280), gate/up one gate_up_proj
    phi = named_shape("phi-4")
    per_layer = (5120 + 7680) + (5120 + 5120) + (5120 + 2 * 17920) + (17920 + 5120)
    assert adapter_elements(phi, all_roles) == 16 * 40 * per_layer
    qv = AdapterProfile(1, 16, ("q_proj", "v_proj"))
    assert adapter_elements(phi, qv) == 16 * 40 * (5120 + 7680)
    # Mixtral: attention, and w1/w3/w2 of each of the 8 experts
    mix = named_shape("mixtral-8x7b")
    attention = 2 * (4096 + 4096) + 2 * (4096 + 1024)
    experts = 8 * 3 * (4096 + 14336)
    assert adapter_elements(mix, all_roles) == 16 * 32 * (attention + experts)
    attn_only = AdapterProfile(1, 16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert adapter_elements(mix, attn_only) == 16 * 32 * attention
    # Qwen3-8B: q is heads x head_dim = 4096 wide, as Llama's
    qwen = named_shape("qwen3-8b")
    assert adapter_elements(qwen, qv) == 16 * 36 * ((4096 + 4096) + (4096 + 1024))


def test_qwen3_moe_dense_layers_and_active_params_follow_the_config(tmp_path: Path) -> None:
    cls, fields = CONFIGS["qwen3-30b-a3b"]
    getattr(transformers, cls)(**{**fields, "mlp_only_layers": [0, 1]}).save_pretrained(tmp_path)
    shape = ModelShape.from_dir(str(tmp_path))
    preset = named_shape("qwen3-30b-a3b")
    assert shape.moe_layers == tuple(range(2, 48))
    expert_layer = 128 * 3 * 2048 * 768 + 2048 * 128
    dense_layer = 3 * 2048 * 6144
    assert preset.num_params() - shape.num_params() == 2 * (expert_layer - dense_layer)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gemma-3-12b", "phi-4"])
def test_plan_reads_a_model_folder_of_each_family(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _config_dir(tmp_path, name)
    code = main(["plan", "--model", str(model), "--gpu", "h200", "--adapters", "100", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    preset = named_shape(name)
    assert out["kv_bytes_per_token"] == KV_PER_TOKEN[name]
    assert out["adapter_bytes"] == adapter_elements(preset, AdapterProfile(1, 16)) * 2
    assert out["memory"]["weights_bytes"] == preset.num_params() * 2
    assert out["model"]["params"] == preset.num_params()


def test_a_moe_step_reads_the_experts_its_tokens_reach_and_computes_with_top_k() -> None:
    """The roofline of a mixture of experts: one decode token reads and computes with its top-k
    experts only (the step costs about what a dense model of the active parameters costs), a
    long prefill chunk reaches every expert but still computes with k per token."""
    from loraplane.planner.cost import GPUS, Roofline, StepShape, streamed_linear_params

    moe, dense = named_shape("qwen3-30b-a3b"), named_shape("qwen3-32b")
    assert streamed_linear_params(moe, 1) == pytest.approx(moe.active_linear_params())
    assert streamed_linear_params(moe, 4096) == pytest.approx(moe.linear_params(), rel=1e-6)
    assert streamed_linear_params(dense, 1) == dense.linear_params()

    def seconds(shape: ModelShape, tokens: int, seqs: int) -> float:
        cost = Roofline(GPUS["h100"], shape, "bfloat16", AdapterProfile(count=1))
        step = StepShape(tokens, seqs, context=tokens, attention=tokens, adapters=0,
                         adapter_bytes=0)  # fmt: skip
        return cost.step_seconds(step) - cost.step_overhead_s

    # decode, one sequence: memory-bound on the ~3.3 B active parameters, not all 30.5 B
    assert seconds(moe, 1, 1) / seconds(dense, 1, 1) < 0.25
    # prefill, 8192 tokens: compute-bound on the active parameters (every expert is read)
    assert seconds(moe, 8192, 1) / seconds(dense, 8192, 1) < 0.2
    assert seconds(moe, 8192, 1) > seconds(moe, 1, 1)
