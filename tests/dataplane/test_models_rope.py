"""RoPE: frequencies for every supported scaling type equal transformers', in both config styles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.dataplane.attention import AttentionMetadata, query_positions
from loraplane.dataplane.models import ModelConfig, load_model
from loraplane.dataplane.models.rope import rope_inv_freq, rope_parameters

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 256,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 256,
}


def _hf_inv_freq(config: dict[str, Any]) -> torch.Tensor:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(transformers.LlamaConfig(**config)).inv_freq


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 10000.0},
        {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
        {"rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "rope_type": "llama3"}},
        {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ],
    ids=["default", "linear-v4", "llama3-v4", "llama3-v5", "default-v5"],
)
def test_inverse_frequencies_equal_transformers_for_each_rope_type_and_config_style(
    rope: dict[str, Any],
) -> None:
    config = {**BASE, **rope}
    ours = rope_inv_freq(ModelConfig.from_dict(config).rope, head_dim=128)
    torch.testing.assert_close(ours, _hf_inv_freq(config), atol=0, rtol=0)


def test_llama3_scaled_model_matches_hf_logits_past_the_original_context(tmp_path: Path) -> None:
    import transformers

    from tests.factories import build_model

    model_dir = build_model(
        tmp_path / "llama3", "llama", rope_parameters={**LLAMA3, "rope_theta": 500000.0}
    )
    tokens = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert model.config.rope.rope_type == "llama3"
    model.allocate_kv_cache(16, 4)
    attn = AttentionMetadata.build([40], [40], [list(range(15, 5, -1))], 4)
    got = model.compute_logits(model(tokens, query_positions([40], [40]), attn))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


LONG_FACTORS = [1.0 + 0.25 * i for i in range(32)]  # 32 = (128 * 0.5) / 2 rotary frequencies
SHORT_FACTORS = [1.0 + 0.01 * i for i in range(32)]
SCALED = [
    ({"rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, None),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1e4}}, 1000),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1e4}}, 100),
    (
        {
            "rope_theta": 1e6,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        None,
    ),
    (
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 1e4,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            }
        },
        None,
    ),
    (
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 5e5,
                "attention_factor": 1.25,
            }
        },
        None,
    ),
    (
        {
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": SHORT_FACTORS,
                "long_factor": LONG_FACTORS,
            },
        },
        None,
    ),
    (
        {
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": SHORT_FACTORS,
                "long_factor": LONG_FACTORS,
                "attention_factor": 1.1,
            },
        },
        65,
    ),
    (
        {
            "partial_rotary_factor": 0.25,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        },
        None,
    ),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, None),
]


def _hf_rope(config: dict[str, Any], seq_len: int | None) -> tuple[torch.Tensor, float]:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(**config)
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

        # Llama's default ignores partial_rotary_factor; Phi-3's (the partial-rotary family)
        # reads it
        return Phi3RotaryEmbedding.compute_default_rope_parameters(hf)
    return ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len=seq_len)


@pytest.mark.parametrize(
    ("rope", "seq_len"),
    SCALED,
    ids=[
        "dynamic-v4", "dynamic-v5-past-max", "dynamic-v5-within-max", "yarn-v4",
        "yarn-mscale-betas-untruncated", "yarn-attention-factor", "longrope-partial-short",
        "longrope-partial-long-attention-factor", "default-partial", "linear-v5",
    ],
)  # fmt: skip
def test_scaled_rope_frequencies_and_attention_scaling_equal_transformers(
    rope: dict[str, Any], seq_len: int | None
) -> None:
    config = {**BASE, **rope}
    ours = ModelConfig.from_dict(config).rope
    inv_freq, scaling = rope_parameters(ours, 128, seq_len)
    expected, expected_scaling = _hf_rope(config, seq_len)
    torch.testing.assert_close(inv_freq, expected, atol=0, rtol=1e-6)
    assert scaling == pytest.approx(expected_scaling, rel=1e-12)
    if ours.rope_type in ("yarn", "longrope"):
        assert scaling != 1.0  # the attention factor is really exercised


def test_rope_parameters_keyed_by_layer_type_give_each_layer_its_own_rope() -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    config = {
        **BASE,
        "model_type": "qwen3",
        "head_dim": 128,
        "num_hidden_layers": 3,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {**yarn, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    parsed = ModelConfig.from_dict(config)
    full, sliding = parsed.layer_rope(0), parsed.layer_rope(1)
    assert parsed.layer_rope(2) == full == parsed.rope and full.rope_type == "yarn"
    assert (sliding.rope_type, sliding.theta) == ("default", 1e4)
    hf = transformers.Qwen3Config(**{k: v for k, v in config.items() if k != "model_type"})
    expected, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu", layer_type="full_attention")
    torch.testing.assert_close(rope_parameters(full, 128)[0], expected, atol=0, rtol=1e-6)
    assert rope_parameters(full, 128)[1] == pytest.approx(scaling)
    torch.testing.assert_close(rope_inv_freq(sliding, 128), _hf_inv_freq(BASE), atol=0, rtol=0)
    # one flat rope_parameters: every layer shares it, no per-layer tables
    flat = ModelConfig.from_dict({**config, "rope_parameters": {**yarn, "rope_theta": 1e6}})
    assert flat.layer_ropes == () and flat.layer_rope(1) == flat.rope


def test_dynamic_ntk_scales_each_sequence_by_its_own_length_in_one_batch(tmp_path: Path) -> None:
    import transformers

    from tests.dataplane.family_parity import build_base

    shape = {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4},
    }  # fmt: skip
    model_dir = build_base(tmp_path / "dynamic", transformers.LlamaConfig, **shape)
    gen = torch.Generator().manual_seed(0)
    short, long = (
        torch.randint(3, 384, (20,), generator=gen),
        torch.randint(3, 384, (50,), generator=gen),
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():  # HF alone: each sequence by itself (HF scales by the batch's longest)
        expected = [hf(t[None]).logits[0] for t in (short, long)]
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    model.allocate_kv_cache(32, 4)
    attn = AttentionMetadata.build([20, 50], [20, 50], [list(range(5)), list(range(5, 18))], 4)
    hidden = model(torch.cat([short, long]), query_positions([20, 50], [20, 50]), attn)
    got = model.compute_logits(hidden)
    torch.testing.assert_close(got[:20], expected[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[20:], expected[1], atol=1e-4, rtol=0)
    # the long sequence really is rotated differently from the plain RoPE
    plain = rope_inv_freq(model.config.rope, model.config.head_dim)
    assert not torch.allclose(rope_parameters(model.config.rope, 16, 50)[0], plain)
