"""Fused <-> split LoRA layouts: an adapter trained on separate q/k/v (gate/up) projections
served on a base whose checkpoint fuses them (Phi-3's `qkv_proj`, `gate_up_proj`), and the
other way round, exactly, as vLLM's packed-modules mapping does.

The math, with `s` a module's scale (alpha / r, or alpha / sqrt(r) with rslora):

- split -> fused: the fused layer's output is the concatenation of the split outputs, so its
  delta must be `[s_q B_q A_q; s_k B_k A_k; s_v B_v A_v]` for every input. Stacking the A's
  along the rank, `A = [A_q; A_k; A_v]` (rank r_q + r_k + r_v), and placing the B's
  block-diagonally, `B = diag(B_q s_q/s, B_k s_k/s, B_v s_v/s)`, gives exactly that (`s` is the
  first part's scale; the others' ratio is folded into their B). When the parts share one A
  (what `split` produces) the fused A is that A and B is the B's stacked by rows, rank r.
  A part the adapter leaves out contributes zero rows of B.
- fused -> split: each part's delta is its rows of the fused delta, `s B[rows] A`: the part
  keeps A and its rows of B; the rank columns where those rows of B are all zero (a
  block-diagonal B from `fuse`) are dropped with A's matching rows, so a split -> fused ->
  split round trip returns the original ranks. A part whose rows are all zero is left out.

Arrays are numpy (`torch.from_numpy` / `.numpy()` share memory with torch tensors on CPU).

Example: an adapter of a Llama-layout model served on Phi-3 (or the reverse with `split`)::

    from loraplane.adapters.packing import LoRAFactors, fuse, split
    q, k, v = (LoRAFactors(a, b, scale) for a, b in ...)   # a [r, hidden], b [out, r]
    qkv = fuse([q, k, v], out_features=(q_out, kv_out, kv_out))
    assert np.allclose(qkv.delta(), np.concatenate([q.delta(), k.delta(), v.delta()]))
    q2, k2, v2 = split(qkv, (q_out, kv_out, kv_out))

`to_fused` / `to_split` do that for a whole adapter's modules, keyed by module path
(`adapter_factors` reads them from a validated adapter).

Experts: a 4.x adapter names each expert's layers (`experts.N.w1`, `w3`, `w2`); transformers
5 packs them into 3-D parameters that PEFT adapts as one (`target_parameters`), its A
[rank x experts, in] with expert-major rows (row e * rank + j) and its B [out, rank x experts]
with rank-major columns (column j * experts + e). `pack_experts` / `unpack_experts` convert
between the two; for `gate_up_proj` fuse each expert's gate and up first (rank 2r), as PEFT's
own conversion does::

    gate_up = pack_experts([fuse([w1[e], w3[e]], (inter, inter)) for e in range(n)])
    down = pack_experts(w2)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.locate import PACKED_MODULES
from loraplane.adapters.safetensors_io import SafetensorsFile
from loraplane.adapters.validate import ValidatedAdapter


@dataclass(frozen=True, slots=True)
class LoRAFactors:
    """One module's LoRA: `delta(x) = scale * b @ (a @ x)`."""

    a: np.ndarray  # [rank, in_features]
    b: np.ndarray  # [out_features, rank]
    scale: float

    def __post_init__(self) -> None:
        if self.a.ndim != 2 or self.b.ndim != 2 or self.a.shape[0] != self.b.shape[1]:
            raise ValueError(
                f"LoRA factors must be A [r, in] and B [out, r], got A {list(self.a.shape)} "
                f"and B {list(self.b.shape)}"
            )

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def delta(self) -> np.ndarray:
        """The dense weight update [out, in] (for tests and merging)."""
        return np.asarray(self.scale * (self.b @ self.a))


def fuse(parts: Sequence[LoRAFactors | None], out_features: Sequence[int]) -> LoRAFactors:
    """The fused module's factors from its parts' (None: a part the adapter leaves out),
    whose outputs are `out_features` rows each, in the fused layer's order."""
    if len(parts) != len(out_features):
        raise ValueError(f"{len(parts)} parts but {len(out_features)} output sizes")
    present = [p for p in parts if p is not None]
    if not present:
        raise ValueError("no part is adapted: nothing to fuse")
    in_features = present[0].a.shape[1]
    dtype = np.result_type(*(p.a.dtype for p in present), *(p.b.dtype for p in present))
    for part, rows in zip(parts, out_features, strict=True):
        if part is not None and (part.a.shape[1] != in_features or part.b.shape[0] != rows):
            raise ValueError(
                f"a part is A {list(part.a.shape)}, B {list(part.b.shape)}: expected "
                f"in_features {in_features} and {rows} output rows"
            )
    scale = present[0].scale
    shared = all(np.array_equal(p.a, present[0].a) for p in present[1:])
    if shared:  # one A for every part: stack the B's, rank unchanged
        a = present[0].a.astype(dtype)
        blocks = [
            (p.b * (p.scale / scale)).astype(dtype) if p is not None
            else np.zeros((rows, a.shape[0]), dtype)
            for p, rows in zip(parts, out_features, strict=True)
        ]  # fmt: skip
        return LoRAFactors(a, np.concatenate(blocks, axis=0), scale)
    a = np.concatenate([p.a for p in present], axis=0).astype(dtype)
    b = np.zeros((sum(out_features), a.shape[0]), dtype)
    row = col = 0
    for part, rows in zip(parts, out_features, strict=True):
        if part is not None:
            b[row : row + rows, col : col + part.rank] = part.b * (part.scale / scale)
            col += part.rank
        row += rows
    return LoRAFactors(a, b, scale)


def split(fused: LoRAFactors, out_features: Sequence[int]) -> list[LoRAFactors | None]:
    """Each part's factors from the fused module's (None for a part with no update)."""
    if sum(out_features) != fused.b.shape[0]:
        raise ValueError(
            f"the parts' {sum(out_features)} output rows do not add up to the fused "
            f"module's {fused.b.shape[0]}"
        )
    parts: list[LoRAFactors | None] = []
    row = 0
    for rows in out_features:
        b = fused.b[row : row + rows]
        row += rows
        keep = np.flatnonzero(np.any(b != 0, axis=0))
        if keep.size == 0:
            parts.append(None)
        elif keep.size == fused.rank:
            parts.append(LoRAFactors(fused.a.copy(), b.copy(), fused.scale))
        else:
            parts.append(LoRAFactors(fused.a[keep], b[:, keep], fused.scale))
    return parts


def _float_array(weights: SafetensorsFile, name: str) -> np.ndarray:
    array = weights.array(name)
    if weights.tensors[name].dtype == "BF16":  # uint16 bit patterns: the high half of an f32
        return (array.astype(np.uint32) << 16).view(np.float32)
    return np.array(array, dtype=np.float32 if array.dtype == np.float16 else array.dtype)


def adapter_factors(adapter: ValidatedAdapter) -> dict[str, LoRAFactors]:
    """A validated adapter's modules as factors (float copies), keyed by module path (its
    `ModuleLoRA.key`); a packed experts parameter's in PEFT's layout (`unpack_experts`)."""
    return {
        m.key: LoRAFactors(
            _float_array(adapter.weights, m.a_name), _float_array(adapter.weights, m.b_name),
            m.scale,
        )
        for m in adapter.modules
    }  # fmt: skip


def part_sizes(spec: BaseModelSpec, fused_module: str) -> tuple[int, ...]:
    """Output rows of each part of `fused_module` (`qkv_proj`, `gate_up_proj`) in `spec`."""
    return tuple(spec.module_shape(m)[1] for m in PACKED_MODULES[fused_module])


def to_fused(modules: Mapping[str, LoRAFactors], spec: BaseModelSpec) -> dict[str, LoRAFactors]:
    """An adapter's modules, keyed by module path (`model.layers.0.self_attn.q_proj`), with
    q/k/v and gate/up fused into qkv_proj and gate_up_proj; other modules unchanged."""
    out: dict[str, LoRAFactors] = {}
    groups: dict[tuple[str, str], dict[str, LoRAFactors]] = {}
    part_of = {p: f for f, parts in PACKED_MODULES.items() for p in parts}
    for path, factors in modules.items():
        parent, _, name = path.rpartition(".")
        if name in part_of:
            groups.setdefault((parent, part_of[name]), {})[name] = factors
        else:
            out[path] = factors
    for (parent, fused_name), parts in groups.items():
        names = PACKED_MODULES[fused_name]
        out[f"{parent}.{fused_name}"] = fuse(
            [parts.get(n) for n in names], part_sizes(spec, fused_name)
        )
    return out


def to_split(modules: Mapping[str, LoRAFactors], spec: BaseModelSpec) -> dict[str, LoRAFactors]:
    """An adapter's modules with qkv_proj and gate_up_proj split into their parts (a part
    with no update is left out); other modules unchanged."""
    out: dict[str, LoRAFactors] = {}
    for path, factors in modules.items():
        parent, _, name = path.rpartition(".")
        if name not in PACKED_MODULES:
            out[path] = factors
            continue
        for part, piece in zip(
            PACKED_MODULES[name], split(factors, part_sizes(spec, name)), strict=True
        ):
            if piece is not None:
                out[f"{parent}.{part}"] = piece
    return out


def pack_experts(experts: Sequence[LoRAFactors]) -> LoRAFactors:
    """One packed parameter's factors, in PEFT's ParamWrapper layout, from each expert's (all
    of one rank; scale ratios folded into B). Its `delta()` means nothing: expert e's update
    is `unpack_experts(...)[e].delta()`."""
    if not experts:
        raise ValueError("no experts to pack")
    rank, scale = experts[0].rank, experts[0].scale
    if any(e.rank != rank for e in experts):
        raise ValueError(
            "the experts' ranks differ ("
            + ", ".join(str(e.rank) for e in experts)
            + "): a packed parameter has one rank"
        )
    count = len(experts)
    a = np.concatenate([e.a for e in experts], axis=0)  # row e * rank + j
    b = np.stack([e.b * (e.scale / scale) for e in experts], axis=2)  # [out, rank, experts]
    return LoRAFactors(a, b.reshape(b.shape[0], rank * count), scale)


def unpack_experts(packed: LoRAFactors, num_experts: int) -> list[LoRAFactors]:
    """Each expert's factors from a packed parameter's (PEFT's ParamWrapper layout)."""
    if num_experts < 1 or packed.rank % num_experts:
        raise ValueError(
            f"a packed rank of {packed.rank} does not split over {num_experts} experts"
        )
    rank = packed.rank // num_experts
    a = packed.a.reshape(num_experts, rank, packed.a.shape[1])
    b = packed.b.reshape(packed.b.shape[0], rank, num_experts)
    return [LoRAFactors(a[e].copy(), b[:, :, e].copy(), packed.scale) for e in range(num_experts)]
