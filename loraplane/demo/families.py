"""The model families the demo can build its base model in (`loraplane demo --family NAME`).

Each is trained from scratch with transformers' own class for that family, at the demo's
size, so no download is needed; its tenants' adapters target what PEFT targets on that
family's checkpoints (Phi-3's fused projections, a mixture of experts' packed experts).
Llama, the default, is the demo as it always was: same shape, same names, same cached build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplane.adapters.base_model import SUPPORTED_MODULES
from loraplane.adapters.families import (
    ATTENTION_MODULES,
    FUSED_ATTENTION_MODULES,
    FUSED_MLP_MODULES,
)

# Every family's block: hidden 128 over 4 heads (2 KV heads), 4 layers
BLOCK: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
PACKED_EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


@dataclass(frozen=True, slots=True)
class DemoFamily:
    """How the demo builds one family's base model and its tenants' adapters."""

    name: str  # the model_type
    title: str  # for people: "Qwen3"
    model_class: str  # transformers' CausalLM class
    config_class: str
    base_name: str  # the base model's name in the API
    extra: dict[str, Any] = field(default_factory=dict)  # config beyond BLOCK
    target_modules: tuple[str, ...] = tuple(SUPPORTED_MODULES)
    target_parameters: tuple[str, ...] = ()  # PEFT's target_parameters (packed experts)

    @property
    def shape(self) -> dict[str, Any]:
        """The config fields the demo sets (besides vocabulary and special tokens)."""
        return {**BLOCK, **self.extra}

    def describe_targets(self) -> str:
        """What each tenant's adapter adapts, in words."""
        if self.target_parameters:
            return "the attention projections and the packed experts"
        if self.target_modules == tuple(SUPPORTED_MODULES):
            return "all seven projection modules"
        return "the fused projections (" + ", ".join(self.target_modules) + ")"


_MOE = {"num_experts_per_tok": 2}
FAMILIES: dict[str, DemoFamily] = {
    f.name: f
    for f in (
        DemoFamily("llama", "Llama", "LlamaForCausalLM", "LlamaConfig", "demo-llama"),
        DemoFamily(
            "qwen3", "Qwen3", "Qwen3ForCausalLM", "Qwen3Config", "demo-qwen3",
            {"head_dim": 64},  # q/k norms; head_dim not hidden / heads
        ),
        DemoFamily(
            "gemma3_text", "Gemma 3 (text)", "Gemma3ForCausalLM", "Gemma3TextConfig",
            "demo-gemma3", {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 32,
                            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
                            "pad_token_id": 0},
        ),
        DemoFamily(
            "phi3", "Phi-3", "Phi3ForCausalLM", "Phi3Config", "demo-phi3",
            {"partial_rotary_factor": 0.5, "pad_token_id": 0},
            target_modules=FUSED_ATTENTION_MODULES + FUSED_MLP_MODULES,
        ),
        DemoFamily(
            "mixtral", "Mixtral", "MixtralForCausalLM", "MixtralConfig", "demo-mixtral",
            {**_MOE, "intermediate_size": 128, "num_local_experts": 4, "pad_token_id": 0},
            target_modules=ATTENTION_MODULES, target_parameters=tuple(PACKED_EXPERTS),
        ),
        DemoFamily(
            "qwen3_moe", "Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "demo-qwen3-moe",
            {**_MOE, "moe_intermediate_size": 128, "num_experts": 4, "norm_topk_prob": True,
             "head_dim": 64, "pad_token_id": 0},
            target_modules=ATTENTION_MODULES, target_parameters=tuple(PACKED_EXPERTS),
        ),
    )
}  # fmt: skip
DEFAULT = "llama"


def family(name: str) -> DemoFamily:
    """The demo family `name`; ValueError naming the choices for any other."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"family: unknown {name!r} (one of {', '.join(FAMILIES)})") from None
