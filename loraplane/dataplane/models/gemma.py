"""Gemma 2 and Gemma 3 (text) over the engine's flat batch and paged KV cache.

What differs from the Llama decoder (`llama.py`), each as transformers 5 computes it
(`models/gemma2/modeling_gemma2.py`, `models/gemma3/modeling_gemma3.py`):
- RMSNorm scales by `1 + weight`, in fp32, and casts the product (Llama casts, then scales);
- the embeddings are multiplied by sqrt(hidden_size), the factor rounded to the weights' dtype;
- GeGLU: down(gelu_tanh(gate(x)) * up(x));
- four norms per layer: the attention's and the MLP's outputs are normed before the residual;
- attention scale `query_pre_attn_scalar ** -0.5`; sliding-window and full layers per
  `layer_types`; Gemma 2 soft-caps the attention scores (`attn_logit_softcapping`) and both
  soft-cap the final logits (`final_logit_softcapping`) with cap * tanh(x / cap);
- Gemma 3 adds RMSNorms over head_dim on q and k (before RoPE) and a RoPE per layer type:
  full layers at base 1e6 with the config's scaling, sliding layers at base 1e4 without.
  transformers does not pass Gemma 3's `attn_logit_softcapping` to its attention, nor does
  its image-text model (`gemma3`) soft-cap the logits, so neither does this model (the
  published Gemma 3 configs set both to null).

Module names are HF's (`model.layers.0.self_attn.q_proj`, `...pre_feedforward_layernorm`), so
checkpoints load by name and LoRA wraps the projections PEFT adapts. The model reuses the
Llama model's cache allocation, forward checks and LoRA hooks by subclassing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from loraplane.dataplane.attention import AttentionMetadata, paged_attention
from loraplane.dataplane.kernels import cpu_linear
from loraplane.dataplane.models.config import (
    GEMMA_ARCHITECTURES,
    ModelConfig,
    RopeConfig,
    UnsupportedModelError,
)
from loraplane.dataplane.models.llama import LlamaForCausalLM, token_embedding
from loraplane.dataplane.models.rope import RotaryEmbedding, apply_rotary

SLIDING, FULL = "sliding_attention", "full_attention"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
# transformers' defaults where a config leaves a field out
_DEFAULT_THETA = {"gemma2": (10_000.0, 10_000.0), "gemma3_text": (1_000_000.0, 10_000.0)}
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3_text": 6}  # every Nth layer is a full one
_DEFAULT_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3_text": (None, None)}


def _optional_cap(config: dict[str, Any], key: str, default: float | None) -> float | None:
    value = config.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModelError(f"config.json field {key!r} must be null or > 0: {value!r}")
    return float(value)


# transformers' config class defaults for the fields a published config may leave out (the Hub's
# gemma-3-4b-it `text_config` lists only six fields): Gemma2Config, Gemma3TextConfig
_SHARED_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {**_SHARED_DEFAULTS, "vocab_size": 256_000, "max_position_embeddings": 8192},
    "gemma3_text": {
        **_SHARED_DEFAULTS,
        "vocab_size": 262_208,
        "max_position_embeddings": 131_072,
    },
}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text stack's config with transformers' defaults filled in: a `gemma3` (image-text)
    config's `text_config` as a `gemma3_text` config, a gemma2 / gemma3_text config itself;
    any other config as it is."""
    model_type = config.get("model_type")
    if model_type == "gemma3":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedModelError("a gemma3 config.json needs a text_config object")
        tied = config.get("tie_word_embeddings", True)
        config, model_type = {"tie_word_embeddings": tied, **text}, "gemma3_text"
    if model_type not in HF_DEFAULTS:
        return config
    return {**HF_DEFAULTS[model_type], **config, "model_type": model_type}


def _layer_types(config: dict[str, Any], family: str, layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", _DEFAULT_PATTERN[family])
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise UnsupportedModelError(f"sliding_window_pattern must be >= 1: {pattern!r}")
        return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {SLIDING, FULL}:
        raise UnsupportedModelError(
            f"layer_types must list {layers} of {SLIDING!r} / {FULL!r}: {types!r}"
        )
    return [str(t) for t in types]


def _ropes(config: dict[str, Any], family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full, sliding) RoPE parameters, flat, from transformers 5's `rope_parameters` keyed
    by layer type or the 4.x `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    full_theta, local_theta = _DEFAULT_THETA[family]
    params = config.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise UnsupportedModelError("rope_parameters per layer type must be objects")
        full = {"rope_type": "default", "rope_theta": full_theta, **full}
        local = {"rope_type": "default", "rope_theta": local_theta, **local}
        return full, local
    if family == "gemma2":  # one RoPE for every layer
        flat = dict(params or config.get("rope_scaling") or {})
        flat.setdefault("rope_theta", config.get("rope_theta", full_theta))
        return flat, flat
    # Gemma 3 written by transformers 4: the scaling applies to the full layers only
    full = dict(config.get("rope_scaling") or params or {})
    full.setdefault("rope_theta", config.get("rope_theta", full_theta))
    local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", local_theta)}
    return full, local


def _rope(config: dict[str, Any], params: dict[str, Any]) -> RopeConfig:
    """One layer type's RoPE, read by RopeConfig's own reader from a flat config."""
    max_pos = config.get("max_position_embeddings")
    return RopeConfig.from_config({"max_position_embeddings": max_pos, "rope_parameters": params})


@dataclass(frozen=True, slots=True)
class GemmaConfig(ModelConfig):
    """A Gemma 2 / Gemma 3 text decoder: the Llama fields plus Gemma's own.

    `rope` is the full layers' RoPE and `local_rope` the sliding layers' (the same for
    Gemma 2); `sliding_windows` says which layers slide.
    """

    local_rope: RopeConfig = field(default_factory=RopeConfig)
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcap: float | None = None  # Gemma 2 only (see the module docstring)
    final_logit_softcap: float | None = None
    qk_norm: bool = False  # Gemma 3

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> GemmaConfig:
        """Parse a gemma2 / gemma3_text / gemma3 config.json (a gemma3 one: its text stack).

        The fields shared with Llama go through ModelConfig's own reader, as a Llama config
        with the same shapes would; UnsupportedModelError names what cannot be served."""
        outer_type = config.get("model_type")
        if outer_type not in GEMMA_ARCHITECTURES:
            raise UnsupportedModelError(f"model_type {outer_type!r} is not a Gemma 2/3 model")
        text = text_config(config)
        family = str(text["model_type"])
        act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_activation {act!r} is not supported for {family}; supported: "
                + ", ".join(_ACTIVATIONS)
            )
        if text.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "use_bidirectional_attention is set: an encoder, not a causal LM to serve"
            )
        full_rope, local_rope = _ropes(text, family)
        llama_view = {
            **{k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling")},
            "model_type": "llama",
            "hidden_act": "silu",  # Gemma's activation is checked above
            "attention_bias": bool(text.get("attention_bias", False)),
            "mlp_bias": False,
            "rope_parameters": full_rope,
        }
        base = ModelConfig.from_dict(llama_view)
        layers = base.num_layers
        window = text.get("sliding_window")
        types = _layer_types(text, family, layers)
        if window is None:
            windows: tuple[int | None, ...] = (None,) * layers
        elif isinstance(window, int) and not isinstance(window, bool) and window > 0:
            windows = tuple(window if t == SLIDING else None for t in types)
        else:
            raise UnsupportedModelError(f"sliding_window must be a positive int: {window!r}")
        attn_cap, final_cap = _DEFAULT_SOFTCAPS[family]
        scalar = text.get("query_pre_attn_scalar")
        if not isinstance(scalar, int | float) or isinstance(scalar, bool) or scalar <= 0:
            raise UnsupportedModelError(f"query_pre_attn_scalar must be > 0: {scalar!r}")
        gemma: dict[str, Any] = {
            "model_type": family,
            "rope": _rope(text, full_rope),
            "sliding_windows": windows,
            "local_rope": _rope(text, local_rope),
            "query_pre_attn_scalar": float(scalar),
            "attn_logit_softcap": (
                _optional_cap(text, "attn_logit_softcapping", attn_cap)
                if family == "gemma2"
                else None
            ),
            # transformers' Gemma3ForConditionalGeneration never soft-caps its logits
            "final_logit_softcap": (
                None
                if outer_type == "gemma3"
                else _optional_cap(text, "final_logit_softcapping", final_cap)
            ),
            "qk_norm": family == "gemma3_text",
        }
        # the Llama reader's values for the shared fields, Gemma's where they differ
        shared = {f.name: getattr(base, f.name) for f in fields(ModelConfig)}
        return cls(**{**shared, **gemma})


# a gemma3 (image-text) checkpoint's text stack: transformers 5 writes `language_model.model.*`
# and `language_model.lm_head.*` (the Hub's layout); its in-memory names `model.language_model.*`
# appear in some exports. The vision tower and the projector are not served.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")  # fmt: skip


def checkpoint_name(name: str) -> str | None:
    """The name of checkpoint tensor `name` in GemmaForCausalLM, None for one it does not use
    (an image-text checkpoint's vision tower and projector)."""
    for prefix, target in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return target + name[len(prefix) :]
    if name.startswith(_VISION_PREFIXES):
        return None
    return name


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in fp32, then cast to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    """Grouped-query attention with Gemma's scale, optional q/k norms, soft-cap and window."""

    def __init__(self, config: GemmaConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        self.softcap = config.attn_logit_softcap
        q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        hidden, bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(hidden, q_out, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_out, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_out, bias=bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=config.o_bias)
        self.q_norm: GemmaRMSNorm | None = None
        self.k_norm: GemmaRMSNorm | None = None
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        self.k_scale = self.v_scale = 1.0  # an FP8 cache's scales (the checkpoint's, if any)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("the KV cache is not allocated: call allocate_kv_cache first")
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(
            q, k, v, self.k_cache, self.v_cache, attn, self.scale, self.sliding_window,
            self.softcap, self.k_scale, self.v_scale,
        )  # fmt: skip
        projected: torch.Tensor = self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        return projected


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gated = F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x)
        out: torch.Tensor = self.down_proj(gated)
        return out


class GemmaDecoderLayer(nn.Module):
    """Norm, attention, norm, residual; norm, MLP, norm, residual."""

    def __init__(self, config: GemmaConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.sliding_windows[layer_idx] is not None
        self.self_attn = GemmaAttention(config, layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        attended = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        x = x + self.post_attention_layernorm(attended)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        out: torch.Tensor = x + self.post_feedforward_layernorm(mlp)
        return out


class LayerTypeRotary(nn.Module):
    """The full layers' and the sliding layers' RoPE tables (one table when they agree)."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.full = RotaryEmbedding(config.rope, config.head_dim)
        self.shared = config.local_rope == config.rope
        self.sliding = self.full if self.shared else RotaryEmbedding(
            config.local_rope, config.head_dim
        )  # fmt: skip

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, attn: AttentionMetadata
    ) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:  # is_sliding -> (cos, sin) [T, dim]
        # attn: the sequences' lengths, which the length-dependent RoPE types read
        full = self.full(positions, dtype, attn)
        sliding = full if self.shared else self.sliding(positions, dtype, attn)
        return {False: full, True: sliding}


class GemmaModel(nn.Module):
    """Scaled embeddings, the decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        layers = [GemmaDecoderLayer(config, i) for i in range(config.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.decoder_layers = layers  # the same modules, typed
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LayerTypeRotary(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        # the factor is rounded to the weights' dtype first, as transformers does (in bf16
        # sqrt(3072) = 55.43 becomes 55.5): the checkpoints were trained that way. A host
        # scalar, so no copy to the device is issued (CUDA graphs capture this forward).
        dtype = self.embed_tokens.weight.dtype
        scale = float(torch.tensor(self.embed_scale, dtype=dtype))
        x = self.embed_tokens(input_ids) * scale
        tables = self.rotary_emb(positions, x.dtype, attn)
        for layer in self.decoder_layers:
            cos, sin = tables[layer.is_sliding]
            x = layer(x, cos, sin, attn)
        out: torch.Tensor = self.norm(x)
        return out


class GemmaForCausalLM(LlamaForCausalLM):
    """A causal LM for model_type gemma2, gemma3_text and gemma3's text stack.

    Cache allocation, `forward`'s checks and the LoRA context are the Llama model's; the
    decoder and the logits' soft-cap are Gemma's.
    """

    def __init__(self, config: GemmaConfig) -> None:
        # LlamaForCausalLM.__init__ would build (and allocate) a Llama decoder first
        nn.Module.__init__(self)
        self.config = config
        self.gemma_config = config
        self.model = GemmaModel(config)  # type: ignore[assignment]  # same interface
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.lora_context = None
        self.kv_cache = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        """fp32 logits, soft-capped in the model's dtype first as transformers does."""
        logits = cpu_linear.apply(self.lm_head, hidden)
        cap = self.gemma_config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
