"""SGMV (segmented gather matrix-vector) LoRA in plain torch: the CPU path and the test oracle.

Tokens arrive grouped by adapter slot (see `LoRABatch`): for each segment the adapter's A is
applied to all of its tokens in one matmul (shrink), then its B (expand), so each adapter's
weights are read once per segment. Adapters keep their own rank (rank-exact): slot k's A is
[r_k, in] and its B [out, r_k]. A Triton kernel replacing these must match them exactly in
meaning; its launcher takes the same arguments, with per-slot weights passed as pointers.

`lora_apply` (shrink, then expand) is the oracle. `lora_apply_grouped` is the CPU serving path:
the same arithmetic with the per-segment work cut to two matmuls, so a step over many adapters
with a token or two each (decodes) is not dominated by per-operation overhead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _check_segments(
    x: torch.Tensor, token_order: torch.Tensor, seg_slots: Sequence[int], seg_bounds: Sequence[int]
) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, features], got shape {tuple(x.shape)}")
    if token_order.dim() != 1 or token_order.dtype != torch.int64:
        raise ValueError("token_order must be a 1-D int64 tensor [N]")
    if len(seg_bounds) != len(seg_slots) + 1:
        raise ValueError(f"seg_bounds needs {len(seg_slots) + 1} entries, got {len(seg_bounds)}")
    if seg_bounds[0] != 0 or seg_bounds[-1] != token_order.numel():
        raise ValueError(
            f"seg_bounds must run from 0 to len(token_order) = {token_order.numel()}, "
            f"got {seg_bounds[0]}..{seg_bounds[-1]}"
        )


def sgmv_shrink(
    x: torch.Tensor,  # [T, in]
    token_order: torch.Tensor,  # [N] int64: rows of x, grouped by segment
    seg_slots: Sequence[int],  # [S]: the slot of each segment
    seg_bounds: Sequence[int],  # [S + 1]: segment s is token_order[seg_bounds[s]:seg_bounds[s+1]]
    lora_a: Sequence[torch.Tensor | None],  # per slot: [r_slot, in], or None (not targeted)
) -> torch.Tensor:  # [N, R], R = the largest rank among the segments' slots
    """Project each adapter token onto its adapter's rank space.

    h = zeros(N, R)
    for s, k in enumerate(seg_slots):
        if lora_a[k] is None: continue
        for n in range(seg_bounds[s], seg_bounds[s + 1]):
            h[n, :rank(k)] = x[token_order[n]] @ lora_a[k].T
    """
    _check_segments(x, token_order, seg_slots, seg_bounds)
    ranks = [a.shape[0] for k in seg_slots if (a := lora_a[k]) is not None]
    h = x.new_zeros(token_order.numel(), max(ranks, default=0))
    for s, slot in enumerate(seg_slots):
        a = lora_a[slot]
        start, end = seg_bounds[s], seg_bounds[s + 1]
        if a is None or start == end:
            continue
        if a.shape[1] != x.shape[1]:
            raise ValueError(f"lora_a[{slot}] is {tuple(a.shape)}, x has {x.shape[1]} features")
        rows = token_order[start:end]
        h[start:end, : a.shape[0]] = x.index_select(0, rows) @ a.t()
    return h


def sgmv_expand(
    y: torch.Tensor,  # [T, out], updated in place
    h: torch.Tensor,  # [N, R] from sgmv_shrink
    token_order: torch.Tensor,  # [N] int64
    seg_slots: Sequence[int],  # [S]
    seg_bounds: Sequence[int],  # [S + 1]
    lora_b: Sequence[torch.Tensor | None],  # per slot: [out, r_slot], or None (not targeted)
    scales: torch.Tensor,  # [max_loras] fp32: each slot's alpha / r (or alpha / sqrt(r))
) -> torch.Tensor:  # y
    """Add each adapter token's scaled up-projection into its row of y.

    for s, k in enumerate(seg_slots):
        if lora_b[k] is None: continue
        for n in range(seg_bounds[s], seg_bounds[s + 1]):
            y[token_order[n]] += (h[n, :rank(k)] @ lora_b[k].T) * scales[k]
    """
    _check_segments(y, token_order, seg_slots, seg_bounds)
    for s, slot in enumerate(seg_slots):
        b = lora_b[slot]
        start, end = seg_bounds[s], seg_bounds[s + 1]
        if b is None or start == end:
            continue
        if b.shape[0] != y.shape[1] or b.shape[1] > h.shape[1]:
            raise ValueError(f"lora_b[{slot}] is {tuple(b.shape)}; y is {tuple(y.shape)}")
        delta = (h[start:end, : b.shape[1]] @ b.t()) * scales[slot]
        y.index_add_(0, token_order[start:end], delta)
    return y


def lora_apply(
    y: torch.Tensor,  # [T, out], the base layer's output; updated in place
    x: torch.Tensor,  # [T, in], the base layer's input
    token_order: torch.Tensor,  # [N] int64
    seg_slots: Sequence[int],  # [S]
    seg_bounds: Sequence[int],  # [S + 1]
    lora_a: Sequence[torch.Tensor | None],  # per slot: [r_slot, in]
    lora_b: Sequence[torch.Tensor | None],  # per slot: [out, r_slot]
    scales: torch.Tensor,  # [max_loras] fp32
) -> torch.Tensor:  # y
    """y[t] += scales[k] * B_k (A_k x[t]) for every adapter token t of slot k (shrink, expand).

    Returns y untouched when no segment's slot targets this module.
    """
    if not any(lora_a[k] is not None for k in seg_slots):
        return y
    h = sgmv_shrink(x, token_order, seg_slots, seg_bounds, lora_a)
    return sgmv_expand(y, h, token_order, seg_slots, seg_bounds, lora_b, scales)


@dataclass(frozen=True, slots=True)
class CheckedPair:
    """A slot's A and B whose shapes fit the layer, with their transposed views."""

    a: torch.Tensor
    b: torch.Tensor
    a_t: torch.Tensor
    b_t: torch.Tensor


def checked_pair(
    slot: int, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> CheckedPair:
    """Slot `slot`'s A and B with their transposed views; ValueError when they do not fit
    input `x` and output `y` (every CPU path checks a slot this way before reading it)."""
    if a.shape[1] != x.shape[1] or b.shape != (y.shape[1], a.shape[0]):
        raise ValueError(
            f"slot {slot}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit"
            f" x {tuple(x.shape)} and y {tuple(y.shape)}"
        )
    return CheckedPair(a, b, a.t(), b.t())


def lora_apply_grouped(
    y: torch.Tensor,  # [T, out], the base layer's output; updated in place
    x: torch.Tensor,  # [T, in], the base layer's input
    token_order: torch.Tensor,  # [N] int64
    token_slots: torch.Tensor,  # [N] int64: the slot of each token of token_order
    seg_slots: Sequence[int],  # [S]
    seg_bounds: Sequence[int],  # [S + 1]
    lora_a: Sequence[torch.Tensor | None],  # per slot: [r_slot, in]
    lora_b: Sequence[torch.Tensor | None],  # per slot: [out, r_slot]
    scales: torch.Tensor,  # [max_loras] fp32
    checked: list[CheckedPair | None] | None = None,  # per slot, kept between calls
) -> torch.Tensor:  # y
    """Same meaning as `lora_apply`, with fewer operations per segment.

    xs = x[token_order]                                   # one gather for every segment
    for each segment (k, start, end) whose slot targets this module:
        delta[start:end] = (xs[start:end] @ A_k.T) @ B_k.T   # written in place
    y[token_order] += delta * scales[token_slots]         # one scale, one scatter-add

    `checked` (one entry per slot, owned by the caller, e.g. ModuleSlots.checked) remembers
    each slot's A and B once their shapes were checked, with their transposed views: a slot
    whose tensors are the same objects as last time costs two identity tests, not a shape
    check and two views (many adapters per step make this the CPU path's per-segment cost).
    """
    _check_segments(x, token_order, seg_slots, seg_bounds)
    if not any(lora_a[k] is not None and lora_b[k] is not None for k in seg_slots):
        return y
    lengths = [seg_bounds[s + 1] - seg_bounds[s] for s in range(len(seg_slots))]
    xs = x.index_select(0, token_order)  # [N, in]
    delta = y.new_zeros(token_order.numel(), y.shape[1])  # [N, out]; untargeted rows stay 0
    # one split op gives every segment's rows as views (no per-segment slicing in Python)
    x_parts, delta_parts = torch.split(xs, lengths), torch.split(delta, lengths)
    mm = torch.mm
    for s, slot in enumerate(seg_slots):
        a, b = lora_a[slot], lora_b[slot]
        if a is None or b is None or not lengths[s]:
            continue
        pair = checked[slot] if checked is not None else None
        if pair is None or pair.a is not a or pair.b is not b:
            pair = checked_pair(slot, a, b, x, y)
            if checked is not None:
                checked[slot] = pair
        mm(mm(x_parts[s], pair.a_t), pair.b_t, out=delta_parts[s])
    delta.mul_(scales.index_select(0, token_slots).unsqueeze(1).to(delta.dtype))
    return y.index_add_(0, token_order, delta)
