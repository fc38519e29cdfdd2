"""The FP8 KV cache (`--kv-cache-dtype fp8`): one byte per cached K/V element.

The cache holds float8 e4m3 (`torch.float8_e4m3fn`, largest magnitude 448) with one scale per
layer for K and one for V (per tensor). A new token's K is written as

    k8 = clamp(k.float() / k_scale, -448, 448).to(fp8)

and attention reads it back as `(k8.float() * k_scale).to(q.dtype)` (V likewise), in the torch
path (`attention.py`) and in the Triton kernel alike. The scales come from the checkpoint when it
has them (`CHECKPOINT_NAMES`: what llm-compressor / compressed-tensors, AutoFP8 and ModelOpt
write, as vLLM reads them), else 1.0, vLLM's default: then K and V must stay within +-448, which
the K and V of the usual bases do by far (values beyond saturate at 448).
"""

from __future__ import annotations

import re

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# (pattern, which scales it sets): a checkpoint tensor naming layer N's K and/or V scale
CHECKPOINT_NAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    # llm-compressor / compressed-tensors (kv_cache_scheme), vLLM's own name
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.k_scale"), "k"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.v_scale"), "v"),
    # older compressed-tensors and AMD Quark: the K and V projections' output scales
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.k_proj\.output_scale"), "k"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.v_proj\.output_scale"), "v"),
    # NVIDIA ModelOpt
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.k_proj\.k_scale"), "k"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.v_proj\.v_scale"), "v"),
    # AutoFP8 (deprecated): one scale for both
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.kv_scale"), "kv"),
)


def cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache's element type for `EngineConfig.kv_cache_dtype` `name` ("auto": the model's).

    On CUDA, fp8 needs a device that converts e4m3 (compute capability 8.9: Ada, Hopper and
    later), which the Triton attention kernel relies on."""
    if name == "auto":
        return model_dtype
    if name != "fp8":
        raise ValueError(f"kv_cache_dtype must be auto or fp8, got {name!r}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use kv_cache_dtype auto"
        )
    return FP8


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether `cache` holds FP8 elements (then K/V are scaled on the way in and out)."""
    return cache.dtype == FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:  # [...] -> [...] fp8
    """x / scale in float8 e4m3, saturated at +-448 (a plain cast would make those NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x8: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """(x8.float() * scale).to(dtype); a cache that is not FP8 is only cast (its scale unused).

    Spelled as a cast then a product in `dtype`: every e4m3 value is exact in fp16, bf16 and
    fp32, and torch multiplies 16-bit tensors in fp32 before rounding, so this is the same
    number, in half the time on CPU (no fp32 copy of the gathered rows)."""
    out = x8.to(dtype)
    return out if x8.dtype != FP8 or scale == 1.0 else out * scale


def scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when checkpoint tensor `name` is a KV cache scale, else None."""
    for pattern, which in CHECKPOINT_NAMES:
        match = pattern.fullmatch(name)
        if match:
            return int(match.group(1)), which
    return None


def scale_value(name: str, tensor: torch.Tensor) -> float:
    """The one positive, finite value a per-tensor scale holds (ValueError naming it if not)."""
    if tensor.numel() != 1:
        raise ValueError(
            f"{name} has {tensor.numel()} values: only per-tensor KV cache scales (one value) "
            "are supported"
        )
    value = float(tensor.float().item())
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} is {value}: a KV cache scale must be positive and finite")
    return value


def read_scales(scales: dict[tuple[int, str], float], num_layers: int) -> list[tuple[float, float]]:
    """Per layer (k_scale, v_scale) from what `scale_target` found, 1.0 where none was."""
    out = [[1.0, 1.0] for _ in range(num_layers)]
    for (layer, which), value in scales.items():
        if layer >= num_layers:
            raise ValueError(f"a KV cache scale names layer {layer}; the model has {num_layers}")
        if "k" in which:
            out[layer][0] = value
        if "v" in which:
            out[layer][1] = value
    return [(k, v) for k, v in out]


def storage_view(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's bytes as `dtype` elements (the adapter arena stores adapters' weights in KV
    blocks, lora/arena.py): [2, L, N, bs, kv, head_dim * size / dtype's size]."""
    if cache.dtype == dtype:
        return cache
    ratio = dtype.itemsize // cache.element_size()
    if ratio < 1 or cache.shape[-1] % ratio:
        raise ValueError(
            f"a {cache.dtype} KV cache with head_dim {cache.shape[-1]} cannot hold {dtype} "
            f"adapter weights in its blocks (head_dim must be a multiple of {ratio}): "
            "turn kv_lora_shared off"
        )
    return cache.view(dtype)
