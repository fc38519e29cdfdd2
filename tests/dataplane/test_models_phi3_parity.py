"""Phi-3 / Phi-4 against HF transformers + PEFT: fused qkv_proj and gate_up_proj (adapters on
the fused names, served fused), partial rotary, LongRoPE's short and long factors and its
attention factor, grouped-query attention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.dataplane.models import ModelConfig
from tests.dataplane.family_parity import (
    Served,
    build_base,
    check,
    engine_greedy_equals_hf,
    mixed_run,
    serve,
)

ORIGINAL = 16  # original_max_position_embeddings: longer sequences use the long factors
SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "original_max_position_embeddings": ORIGINAL,
    "partial_rotary_factor": 0.5,  # 8 of each head's 16 dims rotate: 4 frequencies
    "pad_token_id": 0,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.6],
        "long_factor": [1.0, 2.0, 4.0, 8.0],
    },
}
ALL = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "r8-qkv": {"r": 8, "lora_alpha": 16, "target_modules": ["qkv_proj"]},
    "r16-all": {"r": 16, "lora_alpha": 32, "target_modules": ALL},
    "r32-mlp": {"r": 32, "lora_alpha": 8, "target_modules": ["gate_up_proj", "down_proj"]},
    "r64-rslora": {"r": 64, "lora_alpha": 64, "use_rslora": True, "target_modules": ALL},
}
NAMES: list[str | None] = ["r16-all", None, "r8-qkv", "r64-rslora", "r32-mlp", "r16-all"]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> Served:
    import transformers

    from tests.factories import build_peft_adapter

    root = tmp_path_factory.mktemp("phi3")
    model_dir = build_base(root / "base", transformers.Phi3Config, **SHAPE)
    adapters = {
        name: build_peft_adapter(model_dir, root / name, seed=60 + i, **dict(cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }
    return serve(model_dir, adapters)


def test_phi3_config_reads_fused_projections_partial_rotary_and_longrope() -> None:
    config = ModelConfig.from_dict({"model_type": "phi3", "vocab_size": 64, **SHAPE})
    assert config.fused_projections and not config.qkv_bias
    assert config.rope.rope_type == "longrope" and config.rope.partial_rotary_factor == 0.5
    assert config.rope.original_max_position_embeddings == ORIGINAL
    # Phi-3's old names for LongRoPE, and transformers' default original context (4096)
    old = {**SHAPE, "rope_scaling": {**SHAPE["rope_parameters"], "type": "su"}}
    del old["rope_parameters"], old["original_max_position_embeddings"]
    parsed = ModelConfig.from_dict({"model_type": "phi3", "vocab_size": 64, **old})
    assert parsed.rope.rope_type == "longrope"
    assert parsed.rope.original_max_position_embeddings == 4096


def test_phi3_keeps_the_checkpoints_fused_layers_and_lora_wraps_them(phi3: Served) -> None:
    layer = phi3.model.model.decoder_layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.base_layer.weight.shape == (4 * 16 + 2 * 2 * 16, 64)  # type: ignore[union-attr]
    assert layer.mlp.gate_up_proj.base_layer.weight.shape == (2 * 96, 64)  # type: ignore[union-attr]
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    rotary = phi3.model.model.rotary_emb
    assert rotary.inv_freq.shape == (4,) and rotary.attention_scaling > 1.0


def test_phi3_short_sequences_mixed_batch_chunked_prefill_and_prefix_cache_match_hf_peft(
    phi3: Served,
) -> None:
    # every sequence stays within the original 16 positions: the short factors
    runs = mixed_run(phi3, NAMES, [9, 5, 7, 6, 4, 8], seed=21, decode_steps=3, sharer_tail=3)
    for seq, name in runs:
        assert seq.num_computed <= ORIGINAL
        check(seq, phi3.reference, name)


def test_phi3_long_sequences_mixed_batch_chunked_prefill_and_prefix_cache_match_hf_peft(
    phi3: Served,
) -> None:
    # every sequence is past the original context from its first step: the long factors
    runs = mixed_run(phi3, NAMES, [20, 17, 25, 18, 22, 40], seed=22, sharer_tail=10)
    for seq, name in runs:
        check(seq, phi3.reference, name)


def test_short_and_long_sequences_in_one_batch_each_use_their_own_factors(
    phi3: Served,
) -> None:
    # HF decides short/long for a whole batch; here each sequence decides for itself
    runs = mixed_run(phi3, ["r16-all", "r8-qkv", None], [9, 30, 6], seed=23, decode_steps=2,
                     sharer_tail=3)  # fmt: skip
    lengths = [seq.num_computed for seq, _ in runs]
    assert min(lengths) <= ORIGINAL < max(lengths)
    for seq, name in runs:
        check(seq, phi3.reference, name)


def test_a_wrong_number_of_longrope_factors_is_refused() -> None:
    from loraplane.dataplane.models import UnsupportedModelError

    rope = {**SHAPE["rope_parameters"], "short_factor": [1.0, 1.0]}
    with pytest.raises(UnsupportedModelError, match="short_factor has 2 entries; 4 expected"):
        ModelConfig.from_dict(
            {"model_type": "phi3", "vocab_size": 64, **SHAPE, "rope_parameters": rope}
        )


def test_phi3_base_model_spec_and_pool_know_the_fused_modules(phi3: Served, tmp_path: Path) -> None:
    from loraplane.dataplane.lora.pool import FUSED_MODULES

    pool = phi3.model.lora_context.pool  # type: ignore[union-attr]
    assert {m for _, m in pool.modules} == set(FUSED_MODULES)
    assert torch.is_tensor(pool.modules[(0, "qkv_proj")].scales)


def test_the_engine_generates_hf_peft_greedy_tokens_for_phi3(phi3: Served) -> None:
    # each prompt and its 8 generated tokens stay within the original 16 positions (the long
    # factors are covered above, where each sequence is long from its first step)
    names: list[str | None] = ["r16-all", None, "r8-qkv", "r32-mlp"]
    engine_greedy_equals_hf(phi3, names, [5, 7, 6, 4])
