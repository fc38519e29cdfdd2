"""RoPE: frequencies for every supported scaling type equal transformers', in both config styles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.dataplane.attention import AttentionMetadata, query_positions
from loraplane.dataplane.models import ModelConfig, load_model
from loraplane.dataplane.models.rope import rope_inv_freq

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
