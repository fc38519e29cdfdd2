"""A base model's `config.json`, reduced to what the Llama-family decoder computes with.

Configs written by transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`)
are both read. Anything the decoder would silently compute differently (another architecture,
another activation, an unimplemented RoPE scaling) fails here with a message saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma2", "gemma3_text", "gemma3")
# parsed by models/gemma.py (GemmaConfig, a ModelConfig with Gemma's own fields)
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The base model's config describes something this decoder does not implement."""


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModelError(f"config.json field {key!r} must be a positive int: {value!r}")
    return value


def _float(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise UnsupportedModelError(f"config.json field {key!r} must be a number: {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters; `factor` etc. matter only for the scaled types."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RopeConfig:
        """Read `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise UnsupportedModelError("config.json rope_parameters/rope_scaling must be a dict")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling type {rope_type!r} is not supported; supported: "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        merged = {**config, **params}
        max_pos = config.get("max_position_embeddings") or 8192
        return cls(
            theta=_float(merged, "rope_theta", 10000.0),
            rope_type=rope_type,
            factor=_float(params, "factor", 1.0),
            low_freq_factor=_float(params, "low_freq_factor", 1.0),
            high_freq_factor=_float(params, "high_freq_factor", 4.0),
            original_max_position_embeddings=_int(
                merged, "original_max_position_embeddings", max_pos
            ),
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and options of a Llama / Mistral / Qwen2 decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelConfig:
        """Parse an HF config.json; raise UnsupportedModelError naming the problem."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architectures {config.get('architectures')}) is not "
                f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type in GEMMA_ARCHITECTURES:  # imported here: gemma.py imports this module
            from loraplane.dataplane.models.gemma import GemmaConfig

            return GemmaConfig.from_hf(config)
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: silu")
        hidden = _int(config, "hidden_size")
        heads = _int(config, "num_attention_heads")
        kv_heads = _int(config, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        layers = _int(config, "num_hidden_layers")
        # HF: Qwen2 always has q/k/v biases; only Llama reads attention_bias / mlp_bias.
        llama = model_type == "llama"
        attention_bias = llama and bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(config, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_int(config, "head_dim", hidden // heads),
            rms_norm_eps=_float(config, "rms_norm_eps", 1e-6),
            rope=RopeConfig.from_config(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=llama and bool(config.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(config, model_type, layers),
        )


def _sliding_windows(
    config: dict[str, Any], model_type: str, layers: int
) -> tuple[int | None, ...]:
    """Per-layer attention window, as transformers applies it for each architecture."""
    window = config.get("sliding_window")
    if model_type == "llama" or window is None:
        return (None,) * layers
    window = _int(config, "sliding_window")
    if model_type == "mistral":
        return (window,) * layers
    # qwen2: only when use_sliding_window, and only on the layers layer_types marks
    if not config.get("use_sliding_window", False):
        return (None,) * layers
    types = config.get("layer_types")
    if not isinstance(types, list) or len(types) != layers:
        first = _int(config, "max_window_layers", layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return tuple(window if t == "sliding_attention" else None for t in types)
