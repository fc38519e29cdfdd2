"""A base model's `config.json`, reduced to what the Llama-family decoder computes with.

Configs written by transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`,
flat or keyed by layer type) are both read. Anything the decoder would silently compute
differently (another architecture, another activation, an unimplemented RoPE scaling) fails
here with a message saying so.

The decoder families (`LLAMA_FAMILIES`, built by `llama.py`) and what each reads:
- llama: optional `attention_bias` (q/k/v/o) and `mlp_bias`;
- mistral: `sliding_window` on every layer;
- qwen2: q/k/v biases always; `sliding_window` only with `use_sliding_window`, on the layers
  `layer_types` (or `max_window_layers`) marks;
- qwen3: per-head RMSNorms `q_norm`/`k_norm` over head_dim before RoPE; `head_dim` explicit
  (default 128, not hidden/heads); `attention_bias` (q/k/v/o, default off); windows as qwen2;
- phi3 (Phi-3, Phi-4): fused `qkv_proj` and `gate_up_proj` kept fused; partial rotary
  (`partial_rotary_factor`); `longrope` (the old "su"/"yarn" names mean longrope here);
  `original_max_position_embeddings` at the top level (default 4096); `sliding_window` on every
  layer.
Gemma 2/3 are parsed by `models/gemma.py`, Mixtral and Qwen3-MoE by `models/moe.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the families llama.py's decoder builds; another family adds itself here or below
LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
SUPPORTED_ARCHITECTURES = (
    *LLAMA_FAMILIES, "gemma2", "gemma3_text", "gemma3", "mixtral", "qwen3_moe"
)  # fmt: skip
# parsed by models/gemma.py (GemmaConfig, a ModelConfig with Gemma's own fields)
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text", "gemma3")
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")


def check_supported(config: dict[str, Any]) -> None:
    """UnsupportedModelError unless config.json's model_type is one the engine builds."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} (architectures {config.get('architectures')}) is not "
            f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


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


def _optional_float(params: dict[str, Any], key: str) -> float | None:
    return None if params.get(key) is None else _float(params, key, 0.0)


def _factors(params: dict[str, Any], key: str) -> tuple[float, ...]:
    value = params.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        raise UnsupportedModelError(f"RoPE field {key!r} must be a list of numbers: {value!r}")
    return tuple(float(v) for v in value)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters; `factor` etc. matter only for the scaled types.

    `factor` None (yarn, longrope): max_position_embeddings / original_max_position_embeddings,
    as transformers derives it. `attention_factor` None: the type's own default scaling."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    attention_factor: float | None = None  # yarn, longrope: cos/sin are multiplied by it
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope: per frequency, contexts <= original
    long_factor: tuple[float, ...] = ()  # longrope: per frequency, contexts > original

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RopeConfig:
        """Read a flat `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
        (4.x); a config keyed by layer type is read with `layer_type_ropes`."""
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise UnsupportedModelError("config.json rope_parameters/rope_scaling must be a dict")
        if set(params) & set(LAYER_TYPES):
            return layer_type_ropes(config)["full_attention"]
        return cls._from_params(config, params)

    @classmethod
    def _from_params(cls, config: dict[str, Any], params: dict[str, Any]) -> RopeConfig:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling type {rope_type!r} is not supported; supported: "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        merged = {**config, **params}
        max_pos = config.get("max_position_embeddings") or 8192
        # transformers: a top-level original_max_position_embeddings (Phi-3 writes it there)
        # wins over the one inside the RoPE parameters
        original = config.get("original_max_position_embeddings")
        if original is None:
            original = params.get("original_max_position_embeddings", max_pos)
        scaled = rope_type in ("yarn", "longrope")
        factor = params.get("factor")
        if rope_type == "longrope" and (
            not _factors(params, "short_factor") or not _factors(params, "long_factor")
        ):
            raise UnsupportedModelError("longrope RoPE needs short_factor and long_factor lists")
        return cls(
            theta=_float(merged, "rope_theta", 10000.0),
            rope_type=rope_type,
            factor=None if scaled and factor is None else _float(params, "factor", 1.0),
            low_freq_factor=_float(params, "low_freq_factor", 1.0),
            high_freq_factor=_float(params, "high_freq_factor", 4.0),
            original_max_position_embeddings=_int(
                {"original_max_position_embeddings": original}, "original_max_position_embeddings"
            ),
            max_position_embeddings=_int(
                {"max_position_embeddings": max_pos}, "max_position_embeddings"
            ),
            partial_rotary_factor=_float(merged, "partial_rotary_factor", 1.0),
            attention_factor=_optional_float(params, "attention_factor"),
            # transformers: `params.get("beta_fast") or 32` (a 0 or null means the default)
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=_optional_float(params, "mscale"),
            mscale_all_dim=_optional_float(params, "mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            short_factor=_factors(params, "short_factor"),
            long_factor=_factors(params, "long_factor"),
        )


def layer_type_ropes(config: dict[str, Any]) -> dict[str, RopeConfig]:
    """The RoPE of each layer type (`full_attention`, `sliding_attention`): transformers 5's
    `rope_parameters` keyed by layer type, or one RoPE for both."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or not set(params) & set(LAYER_TYPES):
        rope = RopeConfig.from_config(config)
        return dict.fromkeys(LAYER_TYPES, rope)
    unknown = sorted(set(params) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(
            f"rope_parameters is keyed by layer type but also holds {unknown}; layer types: "
            + ", ".join(LAYER_TYPES)
        )
    ropes = {}
    for layer_type in LAYER_TYPES:
        entry = params.get(layer_type) or params.get("full_attention") or {}
        if not isinstance(entry, dict):
            raise UnsupportedModelError(f"rope_parameters[{layer_type!r}] must be an object")
        ropes[layer_type] = RopeConfig._from_params(config, entry)
    return ropes


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and options of a Llama / Mistral / Qwen2 / Qwen3 / Phi-3 decoder."""

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
    qk_head_norm: bool = False  # Qwen3: RMSNorm over head_dim on each q and k head, pre-RoPE
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj, as the checkpoint has
    layer_ropes: tuple[RopeConfig, ...] = ()  # per layer, when RoPE differs by layer type

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelConfig:
        """Parse a dense Llama-family HF config.json (Llama, Mistral, Qwen2, Qwen3, Phi-3;
        Gemma and the mixtures of experts parse their own, on top of this one: any family
        goes through `models.loader.parse_config`); raise UnsupportedModelError naming the
        problem."""
        check_supported(config)
        model_type: str = config["model_type"]
        if model_type in GEMMA_ARCHITECTURES or model_type in MOE_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is parsed by models.loader.parse_config"
            )
        if model_type == "phi3":
            config = _phi3_config(config)
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
        # HF: Qwen2 always has q/k/v biases; Llama and Qwen3 read attention_bias (q/k/v/o),
        # only Llama reads mlp_bias; Mistral and Phi-3 have none.
        llama = model_type == "llama"
        attention_bias = model_type in ("llama", "qwen3") and bool(
            config.get("attention_bias", False)
        )
        types = _layer_types(config, layers)
        ropes = layer_type_ropes(config)
        layer_ropes = tuple(ropes[t] for t in types)
        head_dim = _int(config, "head_dim", 128 if model_type == "qwen3" else hidden // heads)
        for rope in set(layer_ropes):
            _check_rotary(rope, head_dim)
        return cls(
            model_type=model_type,
            vocab_size=_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(config, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(config, "rms_norm_eps", 1e-6),
            rope=ropes["full_attention"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=llama and bool(config.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(config, model_type, layers),
            qk_head_norm=model_type == "qwen3",
            fused_projections=model_type == "phi3",
            layer_ropes=() if len(set(layer_ropes)) <= 1 else layer_ropes,
        )

    def layer_rope(self, layer_idx: int) -> RopeConfig:
        """The RoPE layer `layer_idx` rotates q and k with."""
        return self.layer_ropes[layer_idx] if self.layer_ropes else self.rope


def _check_rotary(rope: RopeConfig, head_dim: int) -> None:
    rotary = int(head_dim * rope.partial_rotary_factor)
    if rotary < 2 or rotary > head_dim or rotary % 2:
        raise UnsupportedModelError(
            f"partial_rotary_factor {rope.partial_rotary_factor} gives {rotary} rotary dims of "
            f"head_dim {head_dim}: it must be even and between 2 and head_dim"
        )
    want = rotary // 2
    for key, factors in (("short_factor", rope.short_factor), ("long_factor", rope.long_factor)):
        if rope.rope_type == "longrope" and len(factors) != want:
            raise UnsupportedModelError(
                f"longrope {key} has {len(factors)} entries; {want} expected (rotary dims / 2)"
            )


def _phi3_config(config: dict[str, Any]) -> dict[str, Any]:
    """A Phi-3 config as the Llama reader reads it: transformers' Phi3Config calls the old
    "su" / "yarn" scalings longrope, accepts only default and longrope, and defaults
    original_max_position_embeddings (top level) to 4096."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError("config.json rope_parameters/rope_scaling must be a dict")
    params = dict(params)
    rope_type = params.pop("type", None) or params.get("rope_type", "default")
    if rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type not in ("default", "longrope"):
        raise UnsupportedModelError(
            f"phi3 RoPE type {rope_type!r} is not supported; phi3 has default and longrope"
        )
    params["rope_type"] = rope_type
    return {
        **config,
        "original_max_position_embeddings": config.get("original_max_position_embeddings", 4096),
        "rope_parameters": params,
        "rope_scaling": None,
    }


def _layer_types(config: dict[str, Any], layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        return ["full_attention"] * layers
    if not isinstance(types, list) or len(types) != layers or set(types) - set(LAYER_TYPES):
        raise UnsupportedModelError(
            f"layer_types must list {layers} of {', '.join(LAYER_TYPES)}: {types!r}"
        )
    return [str(t) for t in types]


def _sliding_windows(
    config: dict[str, Any], model_type: str, layers: int
) -> tuple[int | None, ...]:
    """Per-layer attention window, as transformers applies it for each architecture."""
    window = config.get("sliding_window")
    if model_type == "llama" or window is None:
        return (None,) * layers
    window = _int(config, "sliding_window")
    if model_type in ("mistral", "phi3"):
        return (window,) * layers
    # qwen2, qwen3: only when use_sliding_window, and only on the layers layer_types marks
    if not config.get("use_sliding_window", False):
        return (None,) * layers
    types = config.get("layer_types")
    if not isinstance(types, list) or len(types) != layers:
        first = _int(config, "max_window_layers", layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return tuple(window if t == "sliding_attention" else None for t in types)
