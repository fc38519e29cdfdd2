"""LoRA by wrapping, not forking: `LinearWithLoRA` adds the adapters' side path to a linear.

`install_lora` walks the model once and wraps every q/k/v/o/gate/up/down projection. The
wrappers share one `LoRAContext`, which the model sets to the step's `LoRABatch` for the
duration of a forward, so the segment metadata is built once per step, not once per layer;
`activate` also takes the pool's stamp (the sum of its per-slot generations) once per step,
which lets each layer skip re-checking its slot tables against the pool (kernels/dispatch.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from loraplane.adapters.base_model import SUPPORTED_MODULES
from loraplane.dataplane.devices import same_device
from loraplane.dataplane.kernels import cpu_linear, dispatch
from loraplane.dataplane.lora import dora
from loraplane.dataplane.lora.metadata import LoRABatch
from loraplane.dataplane.lora.module_slots import ModuleSlots
from loraplane.dataplane.lora.pool import FUSED_MODULES, LoRAPool

# HF names of the projections an adapter may target, e.g. model.layers.3.self_attn.q_proj
# (Phi-3's fused qkv_proj / gate_up_proj included)
WRAPPED_MODULES = tuple(dict.fromkeys(SUPPORTED_MODULES + FUSED_MODULES))
_TARGET = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(WRAPPED_MODULES) + r")$"
)


class LoRAContext:
    """The step's LoRABatch, shared by every LoRA layer of one model."""

    def __init__(self, pool: LoRAPool) -> None:
        self.pool = pool
        self.batch: LoRABatch | None = None
        # the pool's slot_generation summed when the batch was activated: every load and free
        # moves it, so a layer's memo taken at the same stamp is still true
        self.stamp = -1
        # DoRA: per mask of the step's DoRA slots, the rows they rescale (dora.dora_rows)
        self.dora_rows: dict[int, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}

    def activate(self, batch: LoRABatch | None) -> None:
        """Use `batch` for the following forward (None: base model only)."""
        self.dora_rows = {}
        if batch is not None:  # (a static batch's slots are checked when it is refilled)
            for slot in batch.seg_slots:
                if not self.pool.is_loaded(slot):
                    raise ValueError(f"tokens use LoRA slot {slot}, which holds no adapter")
            self.stamp = sum(self.pool.slot_generation)
        self.batch = batch


class LoRAHost(Protocol):
    """A model LoRA can be installed in: HF-style module names and a `lora_context` slot."""

    lora_context: LoRAContext | None

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...

    def get_submodule(self, target: str) -> nn.Module: ...


class LinearWithLoRA(nn.Module):
    """base_layer(x), plus scale * B(A x) for each token whose slot's adapter targets this layer;
    a DoRA adapter's tokens then have that sum (bias aside) scaled per row (lora/dora.py).

    Tokens of the base model (slot -1) and adapters that do not target this (layer, module)
    add nothing.
    """

    def __init__(self, base_layer: nn.Linear, layer_idx: int, module_name: str) -> None:
        super().__init__()
        if module_name not in WRAPPED_MODULES:
            raise ValueError(
                f"module_name {module_name!r} is not one of {', '.join(WRAPPED_MODULES)}"
            )
        self.base_layer = base_layer
        self.layer_idx = layer_idx
        self.module_name = module_name
        self.slots: ModuleSlots | None = None
        self.context: LoRAContext | None = None

    def bind(self, slots: ModuleSlots, context: LoRAContext) -> None:
        """Point this layer at its pool table and the model's shared context."""
        self.slots = slots
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        context, slots = self.context, self.slots
        batch = context.batch if context is not None else None
        if context is None or batch is None or batch.is_empty or slots is None:
            return cpu_linear.apply(self.base_layer, x)
        # on the CPU, the base linear and the native LoRA kernel in one call where both serve
        y = cpu_linear.apply_lora(self.base_layer, x, batch, slots, context.stamp)
        if y is None:
            # Triton SGMV/BGMV kernels on CUDA, the native or torch path elsewhere
            # (dispatch.py); the Triton kernels also rescale DoRA rows where they store y (bias
            # left out)
            y = cpu_linear.apply(self.base_layer, x)
            y = dispatch.lora_apply(y, x, batch, slots, context.stamp, self.base_layer.bias)
        # DoRA rows on the torch and native paths (a static batch's mask is 0: its kernels
        # rescale them)
        mask = slots.dora_mask & batch.slot_mask
        if mask and not dispatch.fuses_dora(batch, x):
            rows = context.dora_rows.get(mask)
            if rows is None:  # the first module this step with these DoRA slots
                rows = context.dora_rows[mask] = dora.dora_rows(batch, slots)
            dora.rescale(y, slots, rows, self.base_layer.bias)
        return y

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, module={self.module_name}"


def install_lora(model: LoRAHost, pool: LoRAPool) -> LoRAContext:
    """Wrap every adaptable projection of `model` in LinearWithLoRA, bound to `pool`.

    The context the wrappers share is stored in `model.lora_context` and returned; the model
    activates it around each forward. Installing twice is an error.
    """
    if model.lora_context is not None:
        raise ValueError("LoRA layers are already installed in this model")
    context = LoRAContext(pool)
    targets = []
    for name, module in model.named_modules():
        match = _TARGET.match(name)
        if match is not None and isinstance(module, nn.Linear):
            targets.append((name, int(match.group(1)), match.group(2), module))
    if not targets:
        raise ValueError("the model has no q/k/v/o/gate/up/down projections to wrap")
    weight = targets[0][3].weight
    dtype = getattr(targets[0][3], "compute_dtype", weight.dtype)  # FP8 weights: models/quant.py
    if dtype != pool.dtype or not same_device(weight.device, pool.device):
        raise ValueError(
            f"pool dtype/device {pool.dtype}/{pool.device} differ from the model's "
            f"{dtype}/{weight.device}"
        )
    for name, layer_idx, module_name, linear in targets:
        wrapper = LinearWithLoRA(linear, layer_idx, module_name)
        slots = pool.module_slots(layer_idx, module_name)
        slots.base = linear  # DoRA's norm reads its weight (lora/dora_slots.py)
        wrapper.bind(slots, context)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, wrapper)
    bind_experts = getattr(model, "bind_expert_lora", None)
    if callable(bind_experts):  # a mixture of experts: its blocks apply the experts' LoRA
        bind_experts(pool, context)
    model.lora_context = context
    return context
