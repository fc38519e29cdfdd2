"""Multi-LoRA serving: adapter loading, the rank-exact slot pool, segment metadata, layers."""

from loraplane.dataplane.lora.layers import LinearWithLoRA, LoRAContext, install_lora
from loraplane.dataplane.lora.loader import load_lora
from loraplane.dataplane.lora.metadata import BASE_SLOT, LoRABatch
from loraplane.dataplane.lora.module_slots import ModuleSlots
from loraplane.dataplane.lora.pool import LoRAPool
from loraplane.dataplane.lora.weights import LoadedAdapter, LoRAWeights

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
