"""DoRA at inference: a per-row scale of the adapted layer's output, fixed when it is loaded.

PEFT's DoRA layer computes, for a linear of weight W [out, in] and bias b,

    y = g * (W x + s * B (A x)) + b,    g = m / ||W + s * B A||_row   # [out]

where m is the adapter's magnitude vector and the norm, per output row over the input
dimension, is detached: it depends on the weights alone. So `dora_scale` computes g once per
module, in fp32 on the pool's device, when the pool makes the adapter's host copy
(`LoRAPool.host_form`, on the manager's loader threads: lora/dora_cache.py, which also keeps g
per node), and the host copy carries it (`DoRAWeights`); filling a slot on the engine thread
only copies g (on CPU, reads it in place). Serving a DoRA token costs the plain LoRA update
plus the rescale: its rows of y, bias taken out, times g. On the torch and native CPU paths
that is `rescale`, in torch after the update; the Triton kernels (CUDA, eager or replayed in
a CUDA graph) do it in their epilogue, where they store y, reading g through their slot
table's pointers (kernels/dora_triton.py). Rows of plain LoRA adapters and of the base model
are not touched.

Measured (`benchmarks/lora_cpu.py`, the benchmark model's q/v at rank 16, one torch thread, CPU
time, three runs): filling a slot 1.5-1.6x a plain adapter's (188-205 against 125-131 us); a
first-ever cold load 6.1-6.4x (14.5-15.3 against 2.4-2.5 ms: the norm, one [out, in] x [in, r]
product per module, is most of it, on a loader thread); with g in the norm cache's folder
(a restart) 1.4-1.5x (3.5-3.6 ms).

A quantized projection (FP8, 4-bit) gives its weight dequantized, as the model computes with it
(`base_weight`), so g is PEFT's on the dequantized checkpoint. Under tensor parallelism a
column-parallel rank holds whole rows of W and computes its rows' g alone; a row-parallel one
(o_proj, down_proj) holds a slice of every row's columns, so the ranks add up their slices'
squares (`norm_sq`) in one all-reduce when the adapter takes a slot (`LoRAPool.sync_norms`),
before any step reads g.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from loraplane.dataplane.lora.weights import LoRAWeights

if TYPE_CHECKING:
    from loraplane.dataplane.lora.metadata import LoRABatch
    from loraplane.dataplane.lora.module_slots import ModuleSlots

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# elements of a base weight a fingerprint hashes besides its row norms (`base_print`)
PRINT_SAMPLES = 4096
# the most bytes of a 16-bit base weight's fp32 copy the norm makes at a time (`_row_slices`)
CHUNK_BYTES = 32 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class DoRAWeights(LoRAWeights):
    """A DoRA module of a pool's host copy (`LoRAPool.host_form`): its A, B, scale and m,
    and g = m / ||W + s B A||_row computed from that pool's base weight, so that filling a
    slot only copies g (or, on CPU, reads it in place)."""

    g: torch.Tensor  # [out] fp32, on the host (pinned for a CUDA pool)

    @property
    def nbytes(self) -> int:
        """Bytes of A, B, m and g."""
        m = self.magnitude.nbytes if self.magnitude is not None else 0
        return self.a.nbytes + self.b.nbytes + m + self.g.nbytes


def refusal(base: nn.Module | None) -> str | None:
    """Why DoRA cannot be served on the projection `base` (None: it can)."""
    if base is None:
        return "no base weight is registered for it (the model's LoRA layers are not installed)"
    if callable(getattr(base, "dequantized", None)):
        return None  # FP8, 4-bit: the norm reads the weight the model computes with
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _FLOATS:
        return (
            f"the base projection ({type(base).__name__}) has no floating-point weight for "
            "DoRA's norm ||W + s B A|| to read (train the adapter without use_dora)"
        )
    return None


def base_weight(base: nn.Module | None) -> torch.Tensor | None:
    """The W a DoRA norm reads: the projection's weight, or a quantized projection's weight
    dequantized as the model computes with it (models/quant.py FP8Linear, models/quant_w4.py
    W4Linear: a full-size copy each call), so that g is PEFT's on the dequantized checkpoint;
    None without one."""
    if base is None:
        return None
    dequantized = getattr(base, "dequantized", None)
    if callable(dequantized):
        weight = dequantized()
        return weight if isinstance(weight, torch.Tensor) else None
    weight = getattr(base, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.dtype in _FLOATS else None


@torch.no_grad()
def row_norms_sq(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [out] fp64
    """||W_i||^2 of each row of a base weight: what every DoRA adapter's norm starts from
    (the pool keeps it per module once the first DoRA adapter there needed it)."""
    out = torch.empty(weight.shape[0], dtype=torch.float64, device=weight.device)
    for rows in _row_slices(weight):
        out[rows] = torch.linalg.vector_norm(weight[rows].float(), dim=1, dtype=torch.float64)
    return out.square_()


def _row_slices(weight: torch.Tensor) -> list[slice]:
    """Slices of W's rows whose fp32 copies take at most CHUNK_BYTES each (a 16-bit W is read
    a slice at a time: an 8B model's MLP projection in fp32 is 235 MB, more than a device
    whose KV cache took the rest may have free); one slice for an fp32 W (no copy)."""
    out_rows, in_cols = weight.shape
    if weight.dtype == torch.float32:
        return [slice(0, out_rows)]
    step = max(1, CHUNK_BYTES // (4 * max(1, in_cols)))
    return [slice(start, min(start + step, out_rows)) for start in range(0, out_rows, step)]


@torch.no_grad()
def base_print(weight: torch.Tensor, base_sq: torch.Tensor) -> bytes:
    """A fingerprint of a base weight W [out, in]: its shape, dtype, row norms (`base_sq`,
    fp64) and PRINT_SAMPLES of its elements spread over it. What the norm cache keys g on
    (lora/dora_cache.py): another W with the same fingerprint would need every row's norm
    equal to the last bit and the same sampled elements (a checkpoint with rows permuted
    within themselves and no sampled element moved), not a case of real checkpoints."""
    flat = weight.detach().reshape(-1)
    stride = max(1, flat.numel() // PRINT_SAMPLES)
    sample = flat[::stride][:PRINT_SAMPLES].float().cpu()
    h = hashlib.sha256(f"{tuple(weight.shape)} {weight.dtype}".encode())
    h.update(base_sq.double().cpu().numpy().tobytes())
    h.update(sample.numpy().tobytes())
    return h.digest()


@torch.no_grad()
def norm_sq(
    weight: torch.Tensor,  # [out, in]: the base layer's weight W (or a slice of its columns)
    a: torch.Tensor,  # [r, in]: A (its same columns)
    b: torch.Tensor,  # [out, r]
    scale: float,  # s: alpha / r (or alpha / sqrt(r))
    base_sq: torch.Tensor | None = None,  # [out] fp64: row_norms_sq(weight), if known
) -> torch.Tensor:  # [out] fp64: ||W_i + s B_i A||^2
    """The square of each row's norm, expanded, never forming the [out, in] matrix W + s B A:

        ||W_i + s B_i A||^2 = ||W_i||^2 + 2 s B_i . (W A^T)_i + s^2 B_i (A A^T) B_i^T

    so it reads W once, in one [out, in] x [in, r] product (a 16-bit W in row slices, each
    copied to fp32 within CHUNK_BYTES), and the rest is [out, r] work; the rows' ||W_i||^2
    come from `base_sq` and the sums run in fp64. Every term sums over the
    input columns, so the squares of column slices (a row-parallel rank's W and A) add up to
    the whole row's (`LoRAPool.sync_norms`)."""
    a32, b32 = a.float(), b.float()
    if base_sq is None:
        base_sq = row_norms_sq(weight)
    cross = torch.empty(weight.shape[0], dtype=torch.float64, device=weight.device)
    for rows in _row_slices(weight):  # [out]: B_i . (W A^T)_i
        cross[rows] = (weight[rows].float() @ a32.t()).double().mul_(b32[rows]).sum(1)
    gram = (a32 @ a32.t()).double()  # [r, r]
    update_sq = (b32.double() @ gram).mul_(b32).sum(1)  # [out]: ||B_i A||^2
    return base_sq + (2 * scale) * cross + (scale * scale) * update_sq


def scale_of(norm_sq: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """g = m / sqrt(norm_sq), fp32 on norm_sq's device (an all-zero updated row gives inf, as
    in PEFT; rounding never makes a true 0 negative by much)."""
    norm = norm_sq.clamp_min(0).sqrt_()
    return (magnitude.to(device=norm.device, dtype=torch.float64) / norm).float()


@torch.no_grad()
def dora_scale(
    weight: torch.Tensor,  # [out, in]: the base layer's weight W
    a: torch.Tensor,  # [r, in]
    b: torch.Tensor,  # [out, r]
    scale: float,  # s: alpha / r (or alpha / sqrt(r))
    magnitude: torch.Tensor,  # [out]: the adapter's m, any float dtype, any device
    base_sq: torch.Tensor | None = None,  # [out] fp64: row_norms_sq(weight), if known
) -> torch.Tensor:  # [out] fp32 on weight's device: g = m / ||W + s B A||_row
    """The per-row scale g of a DoRA module, in fp32 (PEFT's norm is detached: it depends on
    the weights alone), from `norm_sq`."""
    return scale_of(norm_sq(weight, a, b, scale, base_sq), magnitude)


def dora_rows(
    batch: LoRABatch, slots: ModuleSlots
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """The rows of y whose slot has a per-row scale in `slots` ([Nd], in token order), for
    each the index of its slot among the returned slots ([Nd], int64), and those slots.
    Depends only on the step's batch and which slots are DoRA here (`LoRAContext` keeps it
    per step and mask, so modules adapted alike share it)."""
    bounds = batch.seg_bounds
    picked = [(s, k) for s, k in enumerate(batch.seg_slots) if slots.dora[k] is not None]
    order = batch.token_order
    if len(picked) == len(batch.seg_slots):
        rows = order
    else:
        rows = torch.cat([order[bounds[s] : bounds[s + 1]] for s, _ in picked])
    counts = torch.tensor([bounds[s + 1] - bounds[s] for s, _ in picked])
    which = torch.repeat_interleave(torch.arange(len(picked)), counts).to(order.device)
    return rows, which, tuple(k for _, k in picked)


def rescale(
    y: torch.Tensor,  # [T, out]: the layer's output, base plus the LoRA update; updated in place
    slots: ModuleSlots,  # slots.dora[k]: slot k's g [out] fp32, or None (not DoRA)
    rows: tuple[torch.Tensor, torch.Tensor, tuple[int, ...]],  # dora_rows(batch, slots)
    bias: torch.Tensor | None,  # [out]: the base layer's bias, left out of the scaling
) -> None:
    """For each token t of a DoRA slot k: y[t] = g_k * (y[t] - bias) + bias (PEFT adds the
    bias after the scaling). A handful of operations per module, however many DoRA segments
    the step has (a gather of the rows and of their slots' g, a multiply, a scatter), after
    the LoRA update on the torch and native paths; the Triton kernels compute the same in
    their epilogue instead (`dispatch.fuses_dora`), and this is their test oracle."""
    index, which, picked = rows
    gs = [g for k in picked if (g := slots.dora[k]) is not None]
    # [1, out] broadcast over one slot's rows, else each row's own slot's g: [Nd, out]
    scale = gs[0].unsqueeze(0) if len(gs) == 1 else torch.stack(gs).index_select(0, which)
    part = y.index_select(0, index).float()  # [Nd, out]
    if bias is None:
        part.mul_(scale)
    else:
        b = bias.float()
        part = torch.addcmul(b, part.sub_(b), scale)
    y.index_copy_(0, index, part.to(y.dtype))
