"""`engine_cpu.py --family NAME`: the decode step of a family's config against the same-shaped
Llama, both built and timed in this process.

Each family gets engine_cpu's shape (hidden 1024, 8 layers, 16 heads / 4 KV heads, MLP 2816,
vocab 32000, fp32) with its own extras on top:
- qwen3: q_norm / k_norm on every head (head_dim 64, as the Llama's);
- phi3: fused qkv_proj and gate_up_proj, partial rotary 0.75 and LongRoPE (Phi-4-mini's);
adapters are rank 16 on every projection the family has (the fused names for phi3).
Figures: the decode step of 64 sequences with no adapters and over 8 adapters, for the family
and for Llama (the median of 24 steps each), and their ratios (goal: at most 1.3). Both engines
hold their batch at once and take their decode steps in turn, one of each, so load from other
processes on a shared machine weighs on both alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file

FAMILIES = ("qwen3", "phi3")
HEAD_DIM = 64


def family_config(family: str, shape: dict[str, Any]) -> tuple[Any, list[str]]:
    """The transformers config of `family` at `shape`, and the modules its adapters target."""
    import transformers

    heads = shape["num_attention_heads"]
    common = {**shape, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    llama_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if family == "llama":
        return transformers.LlamaConfig(**common), llama_modules
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=shape["hidden_size"] // heads), (
            llama_modules
        )
    if family == "phi3":
        rotary = int(shape["hidden_size"] // heads * 0.75)
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.01 * i for i in range(rotary // 2)],
            "long_factor": [1.0 + 0.5 * i for i in range(rotary // 2)],
        }
        config = transformers.Phi3Config(
            **common, partial_rotary_factor=0.75, rope_parameters=rope, pad_token_id=0,
            original_max_position_embeddings=shape["max_position_embeddings"] // 4,
        )  # fmt: skip
        return config, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    raise ValueError(f"--family must be one of {', '.join(FAMILIES)}, not {family!r}")


def build_family(out: Path, family: str, shape: dict[str, Any], seed: int = 0) -> list[str]:
    """Save a seeded random model of `family` (with a tokenizer); its adapters' targets."""
    import transformers

    from loraplane.demo.build import build_tokenizer

    build_tokenizer(out)  # the model's vocabulary is larger: prompts are token ids
    config, modules = family_config(family, shape)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    return modules


def module_shape(config: dict[str, Any], module: str) -> tuple[int, int]:
    """(in, out) of one projection, from config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, k = heads * head_dim, kv * head_dim
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, k), "v_proj": (hidden, k),
        "qkv_proj": (hidden, q + 2 * k), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden),
    }[module]  # fmt: skip


def write_adapter(model: Path, out: Path, modules: list[str], rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter with seeded random A and B on `modules` of every layer."""
    config = json.loads((model / "config.json").read_text())
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            fan_in, fan_out = module_shape(config, module)
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "qkv_proj",
                                              "o_proj") else "mlp"  # fmt: skip
            stem = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = rng.standard_normal((rank, fan_in)) * 0.05
            b = rng.standard_normal((fan_out, rank)) * 0.05
            tensors[f"{stem}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = b.astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": modules, "bias": "none", "base_model_name_or_path": model.name,
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
