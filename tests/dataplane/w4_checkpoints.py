"""4-bit checkpoints of a tiny HF model, written here as the tools people use write them
(llm-compressor's pack-quantized, AutoAWQ's GEMM, GPTQ v1 and v2), by a quantizer and packers of
the tests' own: written from the formats' descriptions, not from the loader's code, so that a
misread packing order shows up as a mismatch, not as the same mistake on both sides.

Each variant gives the 4-bit checkpoint and the same weights dequantized in fp32 (the
reference HF + PEFT runs on), and keeps its integers, scales and zeros for the layer test.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from loraplane.dataplane.models.quant import PROJECTION

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM: nibble k holds column ORDER[k]


@dataclass(frozen=True)
class Variant:
    """One 4-bit checkpoint to write."""

    format: str  # "pack-quantized", "awq", "gptq", "gptq_v2"
    group_size: int  # -1: per output channel
    symmetric: bool
    act_order: bool = False
    scale_dtype: torch.dtype = torch.float16


VARIANTS: dict[str, Variant] = {
    "ct-sym": Variant("pack-quantized", 32, symmetric=True, scale_dtype=torch.bfloat16),
    "ct-asym": Variant("pack-quantized", 32, symmetric=False),
    "ct-channel": Variant("pack-quantized", -1, symmetric=True, scale_dtype=torch.float32),
    "ct-act-order": Variant("pack-quantized", 16, symmetric=False, act_order=True),
    "awq": Variant("awq", 32, symmetric=False),
    "gptq": Variant("gptq", 32, symmetric=True),
    "gptq-v2": Variant("gptq_v2", -1, symmetric=False),
    "gptq-act-order": Variant("gptq", 32, symmetric=True, act_order=True),
}


@dataclass
class Quantized:
    """One projection's integers: W = (q - z[:, g]) * s[:, g] column by column."""

    q: torch.Tensor  # [out, in] int64 in [0, 16)
    scale: torch.Tensor  # [out, groups] in the variant's scale dtype
    zero: torch.Tensor  # [out, groups] int64 (8 where symmetric)
    g_idx: torch.Tensor  # [in] int64

    def dequantized(self) -> torch.Tensor:
        """fp32 [out, in], one group at a time."""
        w = torch.empty(self.q.shape, dtype=torch.float32)
        for g in range(self.scale.shape[1]):
            cols = (self.g_idx == g).nonzero().flatten()
            diff = (self.q[:, cols] - self.zero[:, g : g + 1]).float()
            w[:, cols] = diff * self.scale[:, g : g + 1].float()
        return w


@dataclass
class Checkpoint:
    """A written variant: its folders and each projection's integers."""

    w4: Path
    plain: Path
    layers: dict[str, Quantized] = field(default_factory=dict)


def quantize(weight: torch.Tensor, v: Variant, seed: int) -> Quantized:
    """Min-max 4-bit quantization per group of input columns (a seeded random column order
    under act-order): symmetric scale amax / 7.5 and zero 8, else (max - min) / 15."""
    out, cols = weight.shape
    size = cols if v.group_size == -1 else v.group_size
    order = torch.arange(cols)
    if v.act_order:
        order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(cols, dtype=torch.int64)
    g_idx[order] = torch.arange(cols) // size  # the i-th column visited joins group i // size
    groups = cols // size
    q = torch.empty(out, cols, dtype=torch.int64)
    scale = torch.empty(out, groups, dtype=v.scale_dtype)
    zero = torch.full((out, groups), 8, dtype=torch.int64)
    w = weight.float()
    for g in range(groups):
        cols_g = (g_idx == g).nonzero().flatten()
        block = w[:, cols_g]
        if v.symmetric:
            s = (block.abs().amax(dim=1) / 7.5).clamp(min=1e-6).to(v.scale_dtype)
            z = zero[:, g]
        else:
            lo = block.amin(dim=1).clamp(max=0)
            hi = block.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-6).to(v.scale_dtype)
            # GPTQ v1 cannot store a zero of 0 (it writes z - 1): keep z in [1, 15] there
            z = (-lo / s.float()).round().clamp(1 if v.format == "gptq" else 0, 15).long()
            zero[:, g] = z
        scale[:, g] = s
        q[:, cols_g] = ((block / s.float()[:, None]).round() + z[:, None]).clamp(0, 15).long()
    return Quantized(q, scale, zero, g_idx)


def _words(nibbles: np.ndarray) -> torch.Tensor:
    """[..., 8] uint32 nibbles, k-th into bits 4k..4k+3 -> [...] int32."""
    word = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for k in range(8):
        word |= nibbles[..., k].astype(np.uint32) << np.uint32(4 * k)
    return torch.from_numpy(np.ascontiguousarray(word).view(np.int32))


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[r, c] -> [r, c/8]: eight consecutive columns per word, in order."""
    v = values.numpy().astype(np.uint32)
    return _words(v.reshape(v.shape[0], -1, 8))


def _pack_down(values: torch.Tensor) -> torch.Tensor:
    """[r, c] -> [r/8, c]: eight consecutive rows per word, in order."""
    v = values.numpy().astype(np.uint32)
    return _words(v.reshape(-1, 8, v.shape[1]).transpose(0, 2, 1))


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[r, c] -> [r, c/8]: nibble k of each word holds column AWQ_PACK_ORDER[k] of its eight."""
    v = values.numpy().astype(np.uint32).reshape(values.shape[0], -1, 8)
    return _words(v[..., list(AWQ_PACK_ORDER)])


def projection_tensors(module: str, qz: Quantized, v: Variant) -> dict[str, torch.Tensor]:
    """The tensors a tool of `v.format` writes for one projection."""
    out, cols = qz.q.shape
    if v.format == "pack-quantized":
        tensors = {
            f"{module}.weight_packed": _pack_rows(qz.q),  # signed + 8 == the unsigned q
            f"{module}.weight_scale": qz.scale,
            f"{module}.weight_shape": torch.tensor([out, cols]),
        }
        if not v.symmetric:
            tensors[f"{module}.weight_zero_point"] = _pack_down(qz.zero)
        if v.act_order:
            tensors[f"{module}.weight_g_idx"] = qz.g_idx.to(torch.int32)
        return tensors
    if v.format == "awq":
        return {
            f"{module}.qweight": _pack_awq(qz.q.t().contiguous()),
            f"{module}.qzeros": _pack_awq(qz.zero.t().contiguous()),
            f"{module}.scales": qz.scale.t().contiguous(),
        }
    stored_zero = qz.zero - 1 if v.format == "gptq" else qz.zero
    return {
        f"{module}.qweight": _pack_down(qz.q.t().contiguous()),
        f"{module}.qzeros": _pack_rows(stored_zero.t().contiguous()),
        f"{module}.scales": qz.scale.t().contiguous(),
        f"{module}.g_idx": qz.g_idx.to(torch.int32),
    }


def quantization_config(v: Variant) -> dict[str, Any]:
    """config.json's quantization_config as the tool writes it."""
    if v.format == "pack-quantized":
        weights = {"num_bits": 4, "type": "int", "symmetric": v.symmetric, "dynamic": False,
                   "strategy": "channel" if v.group_size == -1 else "group",
                   "group_size": None if v.group_size == -1 else v.group_size,
                   "actorder": "group" if v.act_order else None,
                   "observer": "minmax"}  # fmt: skip
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head"],
        }
    if v.format == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": v.group_size,
                "zero_point": True, "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": v.group_size,
            "desc_act": v.act_order, "sym": v.symmetric, "true_sequential": True,
            "damp_percent": 0.01, "checkpoint_format": v.format}  # fmt: skip


def write(src: Path, out: Path, name: str) -> Checkpoint:
    """The model in `src` as variant `name`, and dequantized, under `out`."""
    v = VARIANTS[name]
    ckpt = Checkpoint(out / f"w4-{name}", out / f"dequantized-{name}")
    for folder in (ckpt.w4, ckpt.plain):
        shutil.copytree(src, folder)
        (folder / "model.safetensors").unlink()
    w4: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for i, (tensor_name, tensor) in enumerate(sorted(load_file(src / "model.safetensors").items())):
        module = tensor_name.removesuffix(".weight")
        if tensor_name.endswith(".weight") and PROJECTION.match(module):
            qz = quantize(tensor, v, seed=i)
            ckpt.layers[module] = qz
            w4.update(projection_tensors(module, qz, v))
            plain[tensor_name] = qz.dequantized()
        else:
            w4[tensor_name] = tensor.half()  # the rest 16-bit, as such checkpoints ship
            plain[tensor_name] = tensor.half().float()
    save_file(w4, ckpt.w4 / "model.safetensors")
    save_file(plain, ckpt.plain / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (ckpt.w4 / "config.json").write_text(
        json.dumps({**config, "quantization_config": quantization_config(v)})
    )
    return ckpt
