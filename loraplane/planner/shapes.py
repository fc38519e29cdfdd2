"""Base model shapes: named ones (Llama-3 8B/70B, Mistral-7B, Qwen2-7B, ...) or a model folder.

A `ModelShape` is what the planner needs to size a replica: the decoder's dimensions, the
vocabulary and whether the embedding is tied (weights), the KV heads (KV cache) and the module
shapes adapters attach to, which come from the engine's own `BaseModelSpec.module_shape`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplane.adapters.base_model import SUPPORTED_MODULES, BaseModelSpec, read_config

ATTENTION_BIAS_TYPES = ("qwen2",)  # q/k/v projections with a bias


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Dimensions of a Llama-family decoder (HF config.json field names in comments)."""

    name: str
    model_type: str
    num_layers: int  # num_hidden_layers
    hidden_size: int
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False

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

    @property
    def spec(self) -> BaseModelSpec:
        """The adapter core's view of this model (module shapes for adapter bytes)."""
        return BaseModelSpec(
            name=self.name,
            model_type=self.model_type,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear projections (biases included)."""
        spec = self.spec
        per_layer = sum(
            fan_in * fan_out
            for fan_in, fan_out in (spec.module_shape(m) for m in SUPPORTED_MODULES)
        )
        if self.model_type in ATTENTION_BIAS_TYPES:
            per_layer += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return per_layer * self.num_layers

    def num_params(self) -> int:
        """Every parameter the engine loads: embedding, layers, norms and the LM head."""
        embed = self.vocab_size * self.hidden_size
        norms = (2 * self.num_layers + 1) * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.linear_params() + norms + head

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str) -> ModelShape:
        """Read a parsed HF config.json (the engine's supported model types only)."""
        spec = BaseModelSpec.from_config(config, name)
        vocab = config.get("vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"config.json field 'vocab_size' must be a positive int: {vocab!r}")
        max_len = config.get("max_position_embeddings") or 4096  # as the engine defaults it
        return cls(
            name=name,
            model_type=spec.model_type,
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            vocab_size=vocab,
            max_position_embeddings=int(max_len),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_dir(cls, path: str) -> ModelShape:
        """Read `<path>/config.json` (a folder, the file itself, or an s3:// prefix)."""
        return cls.from_config(read_config(path), name=path.rstrip("/").rsplit("/", 1)[-1])


def _shape(name: str, model_type: str, layers: int, hidden: int, heads: int, kv: int,
           inter: int, vocab: int, max_len: int, head_dim: int = 128,
           tied: bool = False) -> ModelShape:  # fmt: skip
    return ModelShape(name, model_type, layers, hidden, heads, kv, head_dim, inter, vocab,
                      max_len, tied)  # fmt: skip


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
    )
}


def named_shape(name: str) -> ModelShape:
    """A named shape (case-insensitive); ValueError listing the known names."""
    shape = SHAPES.get(name.lower())
    if shape is None:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return shape
