"""A decoder layer's small operations on the CPU through the native library (`sgmv_cpu.c`):
RMSNorm (with the residual's add before it) and rotate-half RoPE on q and k.

On a decode step of a small model these tensors are a few rows, and torch's time goes to
dispatching operations, not to arithmetic: `F.rms_norm` on the CPU is a composite of seven
operations, `apply_rotary` five per tensor, at a few microseconds each for every layer of
every step (about 4 ms of a 65 ms step of the SmolLM-135M shape over 8 sequences). Here each is
one call. The arithmetic is torch's in fp32 (each product rounded on its own); the sum of
squares is added in another order, so results agree with the torch path to rounding.

Only fp32 CPU tensors whose rows are dense take this path, where the library loads; anything
else (bf16, CUDA, an odd stride) runs the torch operations, unchanged. `LORAPLANE_CPU_OPS`
(read once, at import): `auto` (this path where it applies) or `torch` (never).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from loraplane.dataplane.kernels import sgmv_cpu
from loraplane.dataplane.kernels.backends import Switch

ENV = "LORAPLANE_CPU_OPS"
MODES = Switch.MODES
_switch = Switch(ENV)


def set_mode(mode: str) -> None:
    """Choose the path for the rest of the process (tests and benchmarks compare the two)."""
    _switch.set(mode)


def mode() -> str:
    return _switch.mode()


def _rows(t: torch.Tensor) -> bool:
    """fp32 on the CPU, 2-D with dense rows."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


def rms_norm(
    x: torch.Tensor,  # [T, dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, dim], x (+ residual) [T, dim]
    """(rms_norm(s) * weight, s) with s = x + residual (s = x without one). With a residual,
    the sum is written into `x` itself on the native path: pass an `x` nothing else reads
    (a layer's fresh output)."""
    lib = sgmv_cpu.library() if _switch.on else None
    if (
        lib is None
        or not _rows(x)
        or (residual is not None and (not _rows(residual) or residual.shape != x.shape))
        or weight.dtype != torch.float32
        or not weight.is_contiguous()
        or weight.shape != (x.shape[1],)
    ):
        s = x if residual is None else x + residual
        return F.rms_norm(s, weight.shape, weight, eps), s
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.loraplane_rms_norm_f32(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
        out.stride(0), x.shape[0], x.shape[1], eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, x


def _heads(t: torch.Tensor) -> bool:
    """fp32 on the CPU, [T, heads, head_dim] with dense heads (rows may be further apart)."""
    return (
        t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.dim() == 3
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
    )


def rope(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,  # [T, rotary_dim]
) -> bool:
    """Rotate q and k in place (`rope.apply_rotary`'s result, written over its input); False
    (nothing written) where the native path does not take these tensors."""
    lib = sgmv_cpu.library() if _switch.on else None
    if lib is None or not (_heads(q) and _heads(k)):
        return False
    rot, tokens = cos.shape[-1], q.shape[0]
    if (
        rot % 2
        or rot > q.shape[2]
        or k.shape[0] != tokens
        or k.shape[2] != q.shape[2]
        or cos.shape != (tokens, rot)
        or sin.shape != cos.shape
        or not all(t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin))
    ):
        return False
    lib.loraplane_rope_f32(
        q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
        q.shape[2], cos.data_ptr(), sin.data_ptr(), rot, tokens, torch.get_num_threads(),
    )  # fmt: skip
    return True


__all__ = ["ENV", "MODES", "mode", "rms_norm", "rope", "set_mode"]
