"""The model families the adapter core knows: where each keeps its decoder layers, which linear
layers a LoRA adapter may adapt in them, and the config.json defaults that change shapes.

Checked against transformers 5's modeling files (the numerical reference):

- llama, mistral, qwen2, qwen3, gemma2, gemma3_text: `self_attn.{q,k,v,o}_proj` and
  `mlp.{gate,up,down}_proj`. Qwen3's and Gemma 3's `q_norm`/`k_norm` are RMSNorms, not linear
  layers, so nothing adapts them.
- gemma3 (`Gemma3ForConditionalGeneration`): the same text stack under
  `model.language_model.layers` (transformers 5; 4.x wrote `language_model.model.layers`),
  with the head dimensions in `text_config`. The vision tower is not served.
- phi3 (Phi-3, Phi-4): checkpoints are already fused: `self_attn.qkv_proj` (out = (heads +
  2 * kv_heads) * head_dim), `self_attn.o_proj`, `mlp.gate_up_proj` (out = 2 * intermediate),
  `mlp.down_proj`.
- mixtral: attention as Llama; the experts, in 4.x checkpoints and adapters one linear layer
  each, `block_sparse_moe.experts.N.{w1,w2,w3}` (w1 gate and w3 up: hidden -> intermediate,
  w2 down), and in transformers 5 packed into 3-D parameters `mlp.experts.gate_up_proj`
  [experts, 2 * intermediate, hidden] and `mlp.experts.down_proj` [experts, hidden,
  intermediate], which PEFT adapts through `target_parameters`. The router (`gate`) is refused.
- qwen3_moe: attention as Qwen3; a layer is sparse unless listed in `mlp_only_layers` or off
  the `decoder_sparse_step`; sparse layers hold `mlp.experts.N.{gate,up,down}_proj` (4.x) or
  the packed `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (5), of
  `moe_intermediate_size`; dense layers hold `mlp.{gate,up,down}_proj` of `intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
FUSED_ATTENTION_MODULES = ("qkv_proj", "o_proj")
FUSED_MLP_MODULES = ("gate_up_proj", "down_proj")
# The packed experts' parameters in the order the experts module registers them: PEFT wraps
# them in that order, so with both targeted the first sits under the second (`base_layer`).
PACKED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
MIXTRAL_EXPERT_MODULES = ("w1", "w2", "w3")


@dataclass(frozen=True, slots=True)
class Family:
    """How one `model_type` lays out its adaptable linear layers."""

    attention: tuple[str, ...]  # in `self_attn`
    mlp: tuple[str, ...]  # a dense layer's MLP, in `mlp` (none for Mixtral)
    experts: tuple[str, ...] = ()  # one expert's linear layers (the 4.x layout)
    expert_block: str = "mlp"  # the block holding experts and router in the 4.x layout
    packed_experts: bool = False  # transformers 5 packs the experts into 3-D parameters
    # Where the decoder layers live (module paths without PEFT's `base_model.model.`); the
    # first is the canonical one (transformers 5), written into stored adapters.
    prefixes: tuple[str, ...] = ("model.", "")
    head_dim_default: int | None = None  # the config class's default; None: hidden // heads
    nested_text_config: bool = False  # the text stack's numbers are under `text_config`
    # Fields a published config.json may leave out, as the transformers config class fills
    # them (Google's Gemma 3 configs omit the heads, head_dim and vocab_size of text_config).
    defaults: tuple[tuple[str, int], ...] = ()

    @property
    def moe(self) -> bool:
        return bool(self.experts)

    def expert_names(self) -> tuple[str, ...]:
        """The names of one layer's expert weights, per-expert and packed, without indices."""
        packed = tuple(f"experts.{p}" for p in PACKED_EXPERT_PARAMS) if self.packed_experts else ()
        return tuple(f"experts.{m}" for m in self.experts) + packed


_LLAMA = Family(ATTENTION_MODULES, MLP_MODULES)
_GEMMA_DEFAULTS = (("hidden_size", 2304), ("intermediate_size", 9216), ("num_hidden_layers", 26),
                   ("num_attention_heads", 8), ("num_key_value_heads", 4))  # fmt: skip
_GEMMA2 = (*_GEMMA_DEFAULTS, ("vocab_size", 256000), ("max_position_embeddings", 8192))
_GEMMA3 = (*_GEMMA_DEFAULTS, ("vocab_size", 262208), ("max_position_embeddings", 131072))
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": Family(ATTENTION_MODULES, MLP_MODULES, head_dim_default=128),
    "gemma2": Family(ATTENTION_MODULES, MLP_MODULES, head_dim_default=256, defaults=_GEMMA2),
    "gemma3_text": Family(ATTENTION_MODULES, MLP_MODULES, head_dim_default=256, defaults=_GEMMA3),
    "gemma3": Family(
        ATTENTION_MODULES,
        MLP_MODULES,
        prefixes=("model.language_model.", "language_model.model."),
        head_dim_default=256,
        nested_text_config=True,
        defaults=_GEMMA3,
    ),
    "phi3": Family(FUSED_ATTENTION_MODULES, FUSED_MLP_MODULES),
    "mixtral": Family(
        ATTENTION_MODULES,
        (),
        experts=MIXTRAL_EXPERT_MODULES,
        expert_block="block_sparse_moe",
        packed_experts=True,
    ),
    "qwen3_moe": Family(ATTENTION_MODULES, MLP_MODULES, experts=MLP_MODULES, packed_experts=True),
}

# Every linear-layer name an adapter_config's target_modules may end with, in some family.
KNOWN_MODULE_NAMES = (
    ATTENTION_MODULES + MLP_MODULES + ("qkv_proj", "gate_up_proj") + MIXTRAL_EXPERT_MODULES
)

_ROUTER = (
    "LoRA on the router `{path}` is not supported: the base model's routing decides which "
    "experts every token reaches, and an adapted router would change it for one tenant only; "
    "train LoRA on the attention projections and the experts"
)
_REFUSED = {
    "embed_tokens": (
        "LoRA on `embed_tokens` (the token embeddings) is not supported: adapters are served "
        "on the decoder's linear layers only"
    ),
    "lm_head": (
        "LoRA on `lm_head` (the output projection) is not supported: adapters are served on the "
        "decoder's linear layers only"
    ),
    "gate": _ROUTER,
}


def refused_module(name: str, path: str | None = None) -> str | None:
    """Why a module named `name` (the last part of a module path) is never adapted, or None.

    `path` is the module's path as the adapter names it, shown in the router's message."""
    why = _REFUSED.get(name)
    if why is None:
        return None
    return why.format(path=path or "mlp.gate")
