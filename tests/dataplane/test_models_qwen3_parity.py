"""Qwen3 against HF transformers + PEFT: per-head q/k norms, an explicit head_dim that is not
hidden / heads, grouped-query attention, and YaRN scaling past the original context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.dataplane.models import ModelConfig, read_config
from tests.dataplane.family_parity import (
    Served,
    build_base,
    check,
    engine_greedy_equals_hf,
    mixed_run,
    serve,
)

# head_dim 32 != 64 / 4: q is 128 wide, k and v 64 (4 heads over 2 KV heads)
SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
ADAPTERS: dict[str, dict[str, Any]] = {
    "r8-qv": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "r16-all": {"r": 16, "lora_alpha": 32},
    "r32-mlp": {"r": 32, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "r64-rslora": {"r": 64, "lora_alpha": 64, "use_rslora": True},
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def _family(root: Path, **overrides: Any) -> Served:
    import transformers

    from tests.factories import build_peft_adapter

    model_dir = build_base(root / "base", transformers.Qwen3Config, **{**SHAPE, **overrides})
    adapters = {
        name: build_peft_adapter(model_dir, root / name, seed=40 + i, **dict(cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }
    return serve(model_dir, adapters)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return _family(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen3_yarn(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return _family(
        tmp_path_factory.mktemp("qwen3-yarn"),
        rope_parameters={**YARN, "rope_theta": 1_000_000.0},
    )


def test_qwen3_config_reads_head_dim_qk_norms_and_no_bias() -> None:
    config = ModelConfig.from_dict(
        {"model_type": "qwen3", "vocab_size": 64, "num_attention_heads": 4, **SHAPE}
    )
    assert (config.head_dim, config.qk_head_norm, config.qkv_bias, config.o_bias) == (
        32,
        True,
        False,
        False,
    )
    biased = ModelConfig.from_dict(
        {"model_type": "qwen3", "vocab_size": 64, **SHAPE, "attention_bias": True}
    )
    assert biased.qkv_bias and biased.o_bias
    # transformers' Qwen3Config default: head_dim 128 when config.json leaves it out
    no_head_dim = {k: v for k, v in SHAPE.items() if k != "head_dim"}
    assert (
        ModelConfig.from_dict({"model_type": "qwen3", "vocab_size": 64, **no_head_dim}).head_dim
        == 128
    )


def test_qwen3_checkpoint_loads_with_per_head_norms(qwen3: Served) -> None:
    attn = qwen3.model.model.decoder_layers[0].self_attn
    assert attn.q_norm is not None and attn.q_norm.weight.shape == (32,)
    assert attn.q_proj.base_layer.weight.shape == (128, 64)  # type: ignore[union-attr]
    hf: Any = qwen3.reference
    hf_norm = hf.base_model.model.model.layers[0].self_attn.q_norm.weight
    torch.testing.assert_close(attn.q_norm.weight, hf_norm, atol=0, rtol=0)
    assert not torch.allclose(hf_norm, torch.ones_like(hf_norm))  # perturbed: the norm matters


def test_qwen3_mixed_batch_chunked_prefill_and_prefix_cache_match_hf_peft(qwen3: Served) -> None:
    names: list[str | None] = ["r16-all", None, "r8-qv", "r64-rslora", "r32-mlp", None, "r16-all"]
    for seq, name in mixed_run(qwen3, names, [11, 6, 9, 13, 7, 5, 15], seed=11):
        check(seq, qwen3.reference, name)


def test_qwen3_with_yarn_matches_hf_peft_past_the_original_context(qwen3_yarn: Served) -> None:
    rope = qwen3_yarn.model.config.rope
    assert rope.rope_type == "yarn" and qwen3_yarn.model.model.rotary_emb.attention_scaling > 1
    # every prompt is longer than the 16 positions of the original context
    names: list[str | None] = ["r64-rslora", None, "r8-qv", "r32-mlp"]
    for seq, name in mixed_run(qwen3_yarn, names, [20, 18, 25, 30], seed=12):
        check(seq, qwen3_yarn.reference, name)


def test_read_config_of_a_saved_qwen3_equals_the_parsed_dict(qwen3: Served, tmp_path: Path) -> None:
    import json

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "vocab_size": 64, **SHAPE}), encoding="utf-8"
    )
    assert read_config(tmp_path).qk_head_norm


def test_the_engine_generates_hf_peft_greedy_tokens_for_qwen3(qwen3: Served) -> None:
    names: list[str | None] = ["r16-all", None, "r8-qv", "r64-rslora", "r32-mlp"]
    engine_greedy_equals_hf(qwen3, names, [30, 7, 12, 19, 5])


@pytest.fixture(scope="module")
def qwen3_bias_window(tmp_path_factory: pytest.TempPathFactory) -> Served:
    # q/k/v/o biases; layer 1 slides over 6 positions, layer 0 attends to everything
    return _family(
        tmp_path_factory.mktemp("qwen3-bias-window"),
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )


def test_qwen3_with_attention_bias_and_a_sliding_layer_matches_hf_peft(
    qwen3_bias_window: Served,
) -> None:
    config = qwen3_bias_window.model.config
    assert config.qkv_bias and config.o_bias and config.sliding_windows == (None, 6)
    names: list[str | None] = ["r16-all", None, "r64-rslora", "r8-qv"]
    for seq, name in mixed_run(qwen3_bias_window, names, [14, 9, 17, 11], seed=13):
        check(seq, qwen3_bias_window.reference, name)
