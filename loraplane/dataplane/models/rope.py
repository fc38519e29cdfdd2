"""Rotary position embeddings (RoPE): default, linear, Llama 3, dynamic NTK, YaRN and LongRoPE.

Frequencies are computed in fp32 and cos/sin cast to the activations' dtype, in the same
order of operations as transformers (`modeling_rope_utils.py`), so fp32 logits agree to
rounding error. YaRN and LongRoPE also scale cos and sin by an attention factor.

Two types depend on how long a sequence is. transformers decides per forward, from the longest
position in the whole batch; here each sequence decides from its own context length, so a
sequence's output never depends on the other tenants' sequences batched with it:
- dynamic (NTK): a sequence longer than max_position_embeddings rotates this step's tokens
  with the base grown for its length (shorter ones use the plain frequencies);
- longrope: a sequence longer than original_max_position_embeddings uses the long factors.
As in transformers' generation with a KV cache, keys already cached keep the rotation they
were written with when a sequence crosses the threshold.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loraplane.dataplane.attention import AttentionMetadata
from loraplane.dataplane.models.config import RopeConfig

LENGTH_DEPENDENT = ("dynamic", "longrope")


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many of each head's dims are rotated (partial_rotary_factor of head_dim)."""
    return int(head_dim * rope.partial_rotary_factor)


def _exponents(dim: int) -> torch.Tensor:  # [dim // 2] fp32: 2i / dim
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _factor(rope: RopeConfig) -> float:
    if rope.factor is not None:
        return rope.factor
    return rope.max_position_embeddings / rope.original_max_position_embeddings


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    # long wavelengths are divided by `factor`, short ones kept, and the band between
    # interpolated smoothly, so the model extends past its pretraining context
    factor = _factor(rope)
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    # frequencies below the correction range are interpolated (divided by factor), those above
    # kept (extrapolated), a linear ramp between; the attention factor sharpens the softmax
    factor, base = _factor(rope), rope.theta
    scaling = rope.attention_factor
    if scaling is None:
        if rope.mscale and rope.mscale_all_dim:
            scaling = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            scaling = _yarn_mscale(factor)
    old_len = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    steps = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((steps - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep, float(scaling)


def _longrope(rope: RopeConfig, dim: int, seq_len: int | None) -> tuple[torch.Tensor, float]:
    factor, old_len = _factor(rope), rope.original_max_position_embeddings
    scaling = rope.attention_factor
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    long = seq_len is not None and seq_len > old_len
    factors = rope.long_factor if long else rope.short_factor
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (ext * rope.theta ** _exponents(dim)), float(scaling)


def rope_parameters(
    rope: RopeConfig, head_dim: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:  # inv_freq [rotary_dim // 2] fp32, attention scaling
    """Inverse frequencies theta^(-2i/d) rescaled as the config's RoPE type says, and the
    factor cos/sin are multiplied by. `seq_len` matters for dynamic and longrope only (None:
    a sequence within the original context)."""
    dim = rotary_dim(rope, head_dim)
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    if rope.rope_type == "longrope":
        return _longrope(rope, dim, seq_len)
    base = rope.theta
    if rope.rope_type == "dynamic":
        max_pos, factor = rope.max_position_embeddings, _factor(rope)
        length = max(seq_len or max_pos, max_pos)
        base = base * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** _exponents(dim))
    if rope.rope_type == "linear":
        return inv_freq / _factor(rope), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    return inv_freq, 1.0


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [rotary_dim // 2] fp32
    """The inverse frequencies of a sequence within the original context."""
    return rope_parameters(rope, head_dim)[0]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of one step, shared by every layer of one RoPE."""

    inv_freq: torch.Tensor  # [rotary_dim // 2] fp32
    long_inv_freq: torch.Tensor  # [rotary_dim // 2] fp32 (longrope only)

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        inv_freq, self.attention_scaling = rope_parameters(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if rope.rope_type == "longrope":
            long = rope_parameters(rope, head_dim, rope.original_max_position_embeddings + 1)[0]
            self.register_buffer("long_inv_freq", long, persistent=False)

    def _per_token_inv_freq(
        self, attn: AttentionMetadata | None, tokens: int, device: torch.device
    ) -> torch.Tensor:  # [T, rotary_dim // 2] fp32
        # on the device, from the metadata's tensors: nothing read back to the host, so a
        # captured CUDA graph replays it with each step's lengths
        if attn is None:
            raise ValueError(
                f"RoPE type {self.rope.rope_type!r} needs each sequence's length: pass attn"
            )
        q_lens = attn.cu_seqlens_q[1:] - attn.cu_seqlens_q[:-1]
        seq_lens = torch.repeat_interleave(attn.context_lens, q_lens, output_size=tokens)
        seq_lens = seq_lens.to(device)[:, None]  # [T, 1]: each token's sequence length
        inv_freq = self.inv_freq.to(device)
        if self.rope.rope_type == "longrope":
            long = seq_lens > self.rope.original_max_position_embeddings
            return torch.where(long, self.long_inv_freq.to(device), inv_freq)
        # dynamic NTK: the base grows with the sequence past max_position_embeddings (in fp32,
        # as transformers' update at run time computes it)
        rope, dim = self.rope, rotary_dim(self.rope, self.head_dim)
        max_pos, factor = rope.max_position_embeddings, _factor(rope)
        length = torch.clamp(seq_lens.float(), min=max_pos)
        base = rope.theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        grown = 1.0 / (base ** _exponents(dim).to(device))
        return torch.where(seq_lens > max_pos, grown, inv_freq)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, attn: AttentionMetadata | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, rotary_dim]
        """cos/sin of each token's position; `attn` (the step's sequences) is needed by the
        length-dependent types (dynamic, longrope)."""
        if self.rope.rope_type in LENGTH_DEPENDENT:
            inv_freq = self._per_token_inv_freq(attn, positions.shape[0], positions.device)
            freqs = positions[:, None].float() * inv_freq
        else:
            freqs = positions[:, None].float() * self.inv_freq[None, :].to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,  # [T, rotary_dim]
) -> torch.Tensor:  # [T, heads, head_dim]
    """x * cos + rotate_half(x) * sin (the half-split, "neox" layout HF checkpoints use) on the
    first rotary_dim dims of each head; the rest (partial rotary) pass through unchanged."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = x_rot * cos[:, None, :] + _rotate_half(x_rot) * sin[:, None, :]
    return torch.cat((rotated, x_pass), dim=-1)
