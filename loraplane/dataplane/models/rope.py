"""Rotary position embeddings (RoPE): default, linear and Llama 3 frequency scaling.

Frequencies are computed in fp32 and cos/sin cast to the activations' dtype, in the same
order of operations as transformers, so fp32 logits agree to rounding error.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loraplane.dataplane.models.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] fp32
    """Inverse frequencies theta^(-2i/d), rescaled as the config's RoPE type says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, and the band between
    # interpolated smoothly, so the model extends past its pretraining context.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of one step, shared by every layer."""

    inv_freq: torch.Tensor  # [head_dim // 2] fp32

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, head_dim]
        freqs = positions[:, None].float() * self.inv_freq[None, :].to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
) -> torch.Tensor:  # [T, heads, head_dim]
    """x * cos + rotate_half(x) * sin (the half-split, "neox" layout HF checkpoints use)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
