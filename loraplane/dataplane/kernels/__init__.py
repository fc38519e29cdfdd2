"""LoRA compute kernels: the torch reference (CPU path, test oracle); Triton ones beside it."""

from loraplane.dataplane.kernels.sgmv_torch import lora_apply, sgmv_expand, sgmv_shrink

__all__ = ["lora_apply", "sgmv_expand", "sgmv_shrink"]
