"""Multi-LoRA serving: adapter loading, the rank-exact slot pool, segment metadata, layers.

The names below load with their module on first use (PEP 562): the API server's process
imports `lora.errors` without torch, which the rest of this package needs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplane.dataplane.lora.layers import LinearWithLoRA, LoRAContext, install_lora
    from loraplane.dataplane.lora.loader import load_lora
    from loraplane.dataplane.lora.metadata import BASE_SLOT, LoRABatch
    from loraplane.dataplane.lora.module_slots import ModuleSlots
    from loraplane.dataplane.lora.pool import LoRAPool
    from loraplane.dataplane.lora.weights import LoadedAdapter, LoRAWeights

_WHERE = {
    "BASE_SLOT": "metadata",
    "LinearWithLoRA": "layers",
    "LoRABatch": "metadata",
    "LoRAContext": "layers",
    "LoRAPool": "pool",
    "LoRAWeights": "weights",
    "LoadedAdapter": "weights",
    "ModuleSlots": "module_slots",
    "install_lora": "layers",
    "load_lora": "loader",
}
__all__ = [
    "BASE_SLOT",
    "LinearWithLoRA",
    "LoRABatch",
    "LoRAContext",
    "LoRAPool",
    "LoRAWeights",
    "LoadedAdapter",
    "ModuleSlots",
    "install_lora",
    "load_lora",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
