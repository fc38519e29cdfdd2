"""Base model shapes: named ones (Llama-3, Mistral-7B, Qwen2/Qwen3, Gemma 3, Phi-4, Mixtral,
Qwen3-30B-A3B, ...) or a model folder of any family the adapter core knows.

A `ModelShape` is what the planner needs to size a replica: the decoder's dimensions, the KV
heads (KV cache), a mixture of experts' expert count and the module shapes adapters attach to
(fused names for Phi-3, one entry per expert in a sparse layer), all of them the adapter
core's own `BaseModelSpec`, which it holds; and its own: the vocabulary and whether the
embedding is tied (weights), and a mixture of experts' top-k (total vs active parameters).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from loraplane.adapters.base_model import (
    W4_GROUP,
    BaseModelSpec,
    checkpoint_w4_group,
    fp8_block,
    read_config,
)
from loraplane.adapters.families import FAMILIES

ATTENTION_BIAS_TYPES = ("qwen2",)  # q/k/v projections with a bias
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")  # RMSNorm over head_dim on q, k
FOUR_NORM_TYPES = ("gemma2", "gemma3", "gemma3_text")  # pre/post attention and feed-forward
TIED_BY_DEFAULT = ("gemma2", "gemma3", "gemma3_text")  # tie_word_embeddings' default
# An adapter profile names modules by role, Llama's names; a fused family adapts the fused
# layer a role belongs to, a mixture of experts each expert's layer of that role.
_FUSED_ROLE = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip
_MIXTRAL_ROLE = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


# The order `plan --json` prints a shape's fields in under "model" (`ModelShape.as_dict`)
_JSON_FIELDS = ("name", "model_type", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "num_experts", "experts_per_tok", "moe_intermediate_size",
                "moe_layers")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder as the planner sizes it: the adapter core's `BaseModelSpec` (layers, widths,
    heads, experts: the module shapes adapters attach to), whose fields it reads through
    (`shape.num_layers` is `shape.spec.num_layers`), and what only the planner needs (HF
    config.json field names in comments)."""

    spec: BaseModelSpec
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    experts_per_tok: int = 0  # num_experts_per_tok, top-k: the experts each token runs through
    # a 4-bit checkpoint's inputs per scale (quantization_config; -1: one group per row)
    w4_group: int = W4_GROUP
    # a block-wise FP8 checkpoint's (rows, columns) per scale (quantization_config)
    fp8_block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type must be one of {', '.join(FAMILIES)}")
        if self.moe_layers and not 0 < self.experts_per_tok <= self.num_experts:
            raise ValueError("experts_per_tok must be between 1 and num_experts")

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def model_type(self) -> str:
        return self.spec.model_type

    @property
    def num_layers(self) -> int:
        """num_hidden_layers"""
        return self.spec.num_layers

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def num_heads(self) -> int:
        """num_attention_heads"""
        return self.spec.num_heads

    @property
    def num_kv_heads(self) -> int:
        """num_key_value_heads"""
        return self.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def intermediate_size(self) -> int:
        return self.spec.intermediate_size

    @property
    def num_experts(self) -> int:
        """A mixture of experts' experts per sparse layer (0: dense)."""
        return self.spec.num_experts

    @property
    def moe_intermediate_size(self) -> int:
        """One expert's."""
        return self.spec.moe_intermediate_size

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The sparse layers."""
        return self.spec.moe_layers

    def as_dict(self) -> dict[str, Any]:
        """The shape's numbers, flat (the spec's and the planner's own): `plan --json`."""
        return {field: getattr(self, field) for field in _JSON_FIELDS}

    def _layer_linear(self, layer: int, experts: int) -> int:
        spec = self.spec
        total = 0
        for module in spec.layer_modules(layer):
            if module.startswith("experts.") and int(module.split(".")[1]) >= experts:
                continue  # active count: only the top-k experts run
            fan_in, fan_out = spec.module_shape(module)
            total += fan_in * fan_out
        if spec.is_moe_layer(layer):
            total += self.hidden_size * self.num_experts  # the router
        if self.model_type in ATTENTION_BIAS_TYPES:
            total += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return total

    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear projections (biases, experts and routers
        included)."""
        return _linear_params(self, self.num_experts)

    def active_linear_params(self) -> int:
        """linear_params with only `experts_per_tok` experts per sparse layer: what one token
        computes with (equal to linear_params for a dense model)."""
        return _linear_params(self, self.experts_per_tok)

    def _other_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        per_layer = 4 if self.model_type in FOUR_NORM_TYPES else 2
        norms = (per_layer * self.num_layers + 1) * self.hidden_size
        if self.model_type in QK_NORM_TYPES:
            norms += 2 * self.head_dim * self.num_layers
        head = 0 if self.tie_word_embeddings else embed
        return embed + norms + head

    def num_params(self) -> int:
        """Every parameter the engine loads: embedding, layers, norms and the LM head (every
        expert of a mixture of experts; no vision tower)."""
        return self._other_params() + self.linear_params()

    def active_params(self) -> int:
        """Parameters one token computes with (a mixture of experts' top-k experts only)."""
        return self._other_params() + self.active_linear_params()

    def adapted_shapes(self, modules: tuple[str, ...], layer: int) -> list[tuple[int, int]]:
        """(in, out) of each linear layer an adapter of `modules` (Llama's names, by role)
        adapts in decoder layer `layer`: Phi-3's fused layer once for q/k/v or gate/up, and
        in a sparse layer each expert's layer of the MLP roles."""
        spec = self.spec
        family = spec.family
        names: list[str] = []
        for role in modules:
            name = _FUSED_ROLE.get(role, role) if "qkv_proj" in family.attention else role
            if role in ("gate_proj", "up_proj", "down_proj") and spec.is_moe_layer(layer):
                leaf = _MIXTRAL_ROLE[role] if self.model_type == "mixtral" else role
                names += [f"experts.{e}.{leaf}" for e in range(self.num_experts)]
            elif name not in names and spec.has_module(layer, name):
                names.append(name)
        return [spec.module_shape(n) for n in names]

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str) -> ModelShape:
        """Read a parsed HF config.json (the engine's supported model types only)."""
        spec = BaseModelSpec.from_config(config, name)
        text = config.get("text_config", config) if spec.family.nested_text_config else config
        known = dict(spec.family.defaults)
        vocab = text.get("vocab_size", known.get("vocab_size"))
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"config.json field 'vocab_size' must be a positive int: {vocab!r}")
        max_len = text.get("max_position_embeddings") or known.get(
            "max_position_embeddings", 4096
        )  # as the engine defaults it
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        if tied is None:
            tied = spec.model_type in TIED_BY_DEFAULT
        top_k = text.get("num_experts_per_tok") or (2 if spec.model_type == "mixtral" else 8)
        return cls(
            spec,
            vocab_size=vocab,
            max_position_embeddings=int(max_len),
            tie_word_embeddings=bool(tied),
            experts_per_tok=int(top_k) if spec.num_experts else 0,
            w4_group=checkpoint_w4_group(config),
            fp8_block=fp8_block(config.get("quantization_config")),
        )

    @classmethod
    def from_dir(cls, path: str) -> ModelShape:
        """Read `<path>/config.json` (a folder, the file itself, or an s3:// prefix)."""
        return cls.from_config(read_config(path), name=path.rstrip("/").rsplit("/", 1)[-1])


@functools.lru_cache(maxsize=64)
def _linear_params(shape: ModelShape, experts: int) -> int:
    # cached: the cost model asks once per simulated step
    return sum(shape._layer_linear(i, experts) for i in range(shape.num_layers))


def _shape(name: str, model_type: str, layers: int, hidden: int, heads: int, kv: int,
           inter: int, vocab: int, max_len: int, head_dim: int = 128,
           tied: bool = False, experts: int = 0, top_k: int = 0,
           moe_inter: int = 0) -> ModelShape:  # fmt: skip
    moe_layers = tuple(range(layers)) if experts else ()
    spec = BaseModelSpec(name, model_type, num_layers=layers, hidden_size=hidden,
                         intermediate_size=inter, num_heads=heads, num_kv_heads=kv,
                         head_dim=head_dim, num_experts=experts, moe_intermediate_size=moe_inter,
                         moe_layers=moe_layers)  # fmt: skip
    return ModelShape(spec, vocab, max_len, tied, top_k)


# From each model's published config.json.
SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _shape("llama-3-8b", "llama", 32, 4096, 32, 8, 14336, 128256, 8192),
        _shape("llama-3.1-8b", "llama", 32, 4096, 32, 8, 14336, 128256, 131072),
        _shape("llama-3-70b", "llama", 80, 8192, 64, 8, 28672, 128256, 8192),
        _shape("llama-3.2-1b", "llama", 16, 2048, 32, 8, 8192, 128256, 131072, 64, True),
        _shape("mistral-7b", "mistral", 32, 4096, 32, 8, 14336, 32768, 32768),  # v0.3
        _shape("qwen2-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064, 32768),
        _shape("qwen3-8b", "qwen3", 36, 4096, 32, 8, 12288, 151936, 40960),
        _shape("qwen3-32b", "qwen3", 64, 5120, 64, 8, 25600, 151936, 40960),
        # 128 experts of 768, 8 per token, in every layer (decoder_sparse_step 1)
        _shape(
            "qwen3-30b-a3b",
            "qwen3_moe",
            48,
            2048,
            32,
            4,
            6144,
            151936,
            40960,
            experts=128,
            top_k=8,
            moe_inter=768,
        ),
        # the text stack of Gemma3ForConditionalGeneration (its text_config); no vision tower
        _shape("gemma-3-12b", "gemma3", 48, 3840, 16, 8, 15360, 262208, 131072, 256, True),
        _shape("gemma-3-27b", "gemma3", 62, 5376, 32, 16, 21504, 262208, 131072, 128, True),
        _shape("phi-4", "phi3", 40, 5120, 40, 10, 17920, 100352, 16384),
        _shape(
            "mixtral-8x7b",
            "mixtral",
            32,
            4096,
            32,
            8,
            14336,
            32000,
            32768,
            experts=8,
            top_k=2,
            moe_inter=14336,
        ),
    )
}


def named_shape(name: str) -> ModelShape:
    """A named shape (case-insensitive); ValueError listing the known names."""
    shape = SHAPES.get(name.lower())
    if shape is None:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return shape
