"""Craft adapter files byte by byte, valid and broken, for the validation tests."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from loraplane.adapters.base_model import BaseModelSpec

PREFIX = "base_model.model."
# The tiny base model the adapter, control plane and operator tests validate against.
TINY_BASE_NAME = "tiny"
TINY_BASE_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY_BASE = BaseModelSpec.from_config(TINY_BASE_CONFIG, TINY_BASE_NAME)


def lora_tensors(
    base: BaseModelSpec, r: int, modules: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0
) -> dict[str, np.ndarray]:
    """PEFT-named A and B tensors for every layer of `base`."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(base.num_layers):
        for m in modules:
            fan_in, fan_out = base.module_shape(m)
            stem = PREFIX + base.module_key(layer, m)
            out[f"{stem}.lora_A.weight"] = rng.standard_normal((r, fan_in)).astype(np.float32)
            out[f"{stem}.lora_B.weight"] = rng.standard_normal((fan_out, r)).astype(np.float32)
    return out


def dora_tensors(
    base: BaseModelSpec, r: int, modules: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0
) -> dict[str, np.ndarray]:
    """`lora_tensors` plus a DoRA magnitude vector ([out_features], PEFT's name) per module."""
    out = lora_tensors(base, r, modules, seed)
    rng = np.random.default_rng(seed + 1)
    for name in [n for n in out if n.endswith(".lora_B.weight")]:
        fan_out = out[name].shape[0]
        magnitude = rng.uniform(0.5, 2.0, fan_out).astype(np.float32)
        out[name.removesuffix(".lora_B.weight") + ".lora_magnitude_vector"] = magnitude
    return out


def lora_config(r: int = 8, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
    }
    config.update(extra)
    return config


def write_adapter(
    out: Path, config: dict[str, Any] | bytes, tensors: dict[str, np.ndarray] | bytes
) -> Path:
    """Write adapter_config.json (a dict or raw bytes) and adapter_model.safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    raw = config if isinstance(config, bytes) else json.dumps(config).encode()
    (out / "adapter_config.json").write_bytes(raw)
    weights = out / "adapter_model.safetensors"
    if isinstance(tensors, bytes):
        weights.write_bytes(tensors)
    else:
        save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


def raw_safetensors(
    header: dict[str, Any] | bytes, data: bytes, length: int | None = None
) -> bytes:
    """A safetensors file from a header (dict or raw bytes) and a data section, unchecked."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if length is None else length
    return struct.pack("<Q", n) + body + data


def f32_entry(shape: list[int], begin: int) -> dict[str, Any]:
    size = int(np.prod(shape)) * 4
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + size]}
