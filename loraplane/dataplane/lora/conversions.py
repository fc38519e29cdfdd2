"""Conversions of a loaded adapter to what its base serves: modules of the other layout than
the base's (split q/k/v and gate/up against Phi-3's fused `qkv_proj` / `gate_up_proj`, or the
fused names on a split base) to the base's own (`base_layout`), and packed experts' factors
split per expert on a mixture-of-experts base (`per_expert_modules`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.locate import PACKED_MODULES, counterparts
from loraplane.adapters.packing import LoRAFactors, fuse, part_sizes, split
from loraplane.dataplane.lora.weights import LoadedAdapter, LoRAWeights


def _as_float(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """`t` as a float32 numpy array (an fp32 tensor's own memory, not copied). In numpy, not
    torch: a torch cast of a large tensor on a loader thread would start an OpenMP team that
    competes with the engine's step for its cores (see `host_form.copy_serial`)."""
    if t.dtype == torch.bfloat16:  # the high half of an f32
        bits = t.view(torch.int16).numpy().view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32)
    array: np.ndarray[Any, Any] = t.numpy()
    return array if array.dtype == np.float32 else array.astype(np.float32)


def _as_tensor(array: np.ndarray[Any, Any], dtype: torch.dtype) -> torch.Tensor:
    """A float32 array back in `dtype` (bf16: rounded to nearest even, as torch casts)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == torch.bfloat16:
        bits = array.view(np.uint32)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # no NaN: validated finite
        return torch.from_numpy(rounded.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    if dtype == torch.float16:
        return torch.from_numpy(array.astype(np.float16))
    return torch.from_numpy(array)


def _factors(w: LoRAWeights) -> LoRAFactors:
    return LoRAFactors(_as_float(w.a), _as_float(w.b), w.scale)


def _from_factors(f: LoRAFactors, dtype: torch.dtype) -> LoRAWeights:
    return LoRAWeights(a=_as_tensor(f.a, dtype), b=_as_tensor(f.b, dtype), scale=f.scale)


def base_layout(adapter: LoadedAdapter, base: BaseModelSpec) -> LoadedAdapter:
    """`adapter` with its modules of the other layout converted to `base`'s own, rank-exact
    (`loraplane.adapters.packing`, as vLLM's packed-modules mapping places slices); returned
    as is when it has none.

    - split parts on a fused base (q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`): the
      parts' A's side by side along the rank, their B's block-diagonal, so the fused
      module's rank is the sum of the parts' ranks (one rank when they share one A); a part
      the adapter leaves out is zero rows of B. Validation refused a sum over the pool's
      max rank (`validate.check_served_rank`).
    - a fused name on a split base: each part keeps A and its rows of B (columns that are
      zero in those rows dropped, with A's matching rows); a part with no update is left out.

    The factors are converted in fp32 (numpy) and back to the adapter's dtype: placing slices
    is exact; only a part's scale differing from the first part's is folded into its B."""
    moving = {key: counterparts(base, *key) for key in adapter.modules}
    if all(served is None for served in moving.values()):
        return adapter
    modules: dict[tuple[int, str], LoRAWeights] = {}
    groups: dict[tuple[int, str], dict[str, LoRAWeights]] = {}
    for (layer, module), w in adapter.modules.items():
        served = moving[(layer, module)]
        if served is None:
            modules[(layer, module)] = w
        elif module in PACKED_MODULES:  # fused name, split base
            pieces = split(_factors(w), part_sizes(base, module))
            for part, piece in zip(served, pieces, strict=True):
                if piece is not None:
                    modules[(layer, part)] = _from_factors(piece, w.a.dtype)
        else:
            groups.setdefault((layer, served[0]), {})[module] = w
    for (layer, fused), parts in groups.items():
        names = PACKED_MODULES[fused]
        dtype = next(iter(parts.values())).a.dtype
        whole = fuse([_factors(parts[n]) if n in parts else None for n in names],
                     part_sizes(base, fused))  # fmt: skip
        modules[(layer, fused)] = _from_factors(whole, dtype)
    return LoadedAdapter(adapter.source, modules, adapter.digest)


# one expert's (gate, up, down) names per family, as its checkpoint names them
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def per_expert_modules(adapter: LoadedAdapter, spec: BaseModelSpec) -> LoadedAdapter:
    """`adapter` with any packed experts' factors split into per-expert ones, keyed
    (layer, `experts.N.NAME`) as the pool and 4.x adapters key them; returned as is when it
    has none. A packed `experts.gate_up_proj` becomes N's gate and up linears, which share
    its A (gate: the first half of B's rows, up: the second, as the packed parameter's rows)."""
    names = EXPERT_NAMES.get(spec.model_type)
    packed = [key for key in adapter.modules if key[1] in ("experts.gate_up_proj",
                                                           "experts.down_proj")]  # fmt: skip
    if names is None or not packed:
        return adapter
    gate, up, down = names
    experts = spec.num_experts
    modules: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), w in adapter.modules.items():
        if module not in ("experts.gate_up_proj", "experts.down_proj"):
            modules[(layer, module)] = w
            continue
        rank = w.a.shape[0] // experts
        if rank * experts != w.a.shape[0] or w.b.shape[1] != w.a.shape[0]:
            raise ValueError(
                f"layer {layer} {module}: A {tuple(w.a.shape)} / B {tuple(w.b.shape)} do not "
                f"split into {experts} experts"
            )
        for e in range(experts):
            a = w.a[e * rank : (e + 1) * rank].contiguous()  # [r, in]
            b = w.b[:, e::experts].contiguous()  # [out, r]
            if module == "experts.down_proj":
                modules[(layer, f"experts.{e}.{down}")] = LoRAWeights(a, b, w.scale)
                continue
            half = b.shape[0] // 2
            modules[(layer, f"experts.{e}.{gate}")] = LoRAWeights(a, b[:half].contiguous(),
                                                                  w.scale)  # fmt: skip
            modules[(layer, f"experts.{e}.{up}")] = LoRAWeights(a, b[half:].contiguous(), w.scale)
    return LoadedAdapter(adapter.source, modules, adapter.digest)
