"""`engine_cpu.py --family NAME`: the model and adapters of a family at engine_cpu's shape.

Each dense family gets engine_cpu's shape (hidden 1024, 8 layers, 16 heads / 4 KV heads, MLP
2816, vocab 32000, fp32) with its own extras on top, and is timed against the same-shaped Llama:
- qwen3: q_norm / k_norm on every head (head_dim 64, as the Llama's);
- phi3: fused qkv_proj and gate_up_proj, partial rotary 0.75 and LongRoPE (Phi-4-mini's);
- gemma3 (`gemma3_text`): q/k norms, four (1 + w) norms per layer computed in fp32, GeGLU,
  embeddings scaled by sqrt(hidden), five sliding layers (window 1024) to one global (RoPE base
  1e4 and 1e6), tied embeddings, no soft-caps (Gemma 3's default); head_dim 64;
- gemma2: the same without q/k norms, sliding and global layers alternating, soft-caps on
  (50 on the attention scores, 30 on the logits).
The mixture-of-experts families are timed against themselves, with and without adapters:
- mixtral, qwen3_moe: the same attention (qwen3_moe with its q/k norms), 8 experts, top-2,
  experts 1408 wide, so a token's active MLP (2 x 1408) is the Llama's 2816; every layer
  sparse.
Adapters are rank 16 on every projection the family has (the fused names for phi3; for the MoE
families attention and every expert's three linears, one module per expert as PEFT 0.x writes
them for transformers 4.x checkpoints, `experts.N.w1` / `experts.N.gate_proj` ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file

from loraplane.adapters.base_model import BaseModelSpec

DENSE = ("qwen3", "phi3", "gemma3", "gemma2")
MOE = ("mixtral", "qwen3_moe")
FAMILIES = DENSE + MOE
NUM_EXPERTS, TOP_K = 8, 2
LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = LLAMA_MODULES[:4]


def family_config(family: str, shape: dict[str, Any]) -> tuple[Any, list[str]]:
    """The transformers config of `family` at `shape`, and the modules its adapters target."""
    import transformers

    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    common = {**shape, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    if family == "llama":
        return transformers.LlamaConfig(**common), LLAMA_MODULES
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=head_dim), LLAMA_MODULES
    if family == "phi3":
        rotary = int(head_dim * 0.75)
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.01 * i for i in range(rotary // 2)],
            "long_factor": [1.0 + 0.5 * i for i in range(rotary // 2)],
        }
        phi3 = {
            **common,
            "partial_rotary_factor": 0.75,
            "rope_parameters": rope,
            "pad_token_id": 0,
            "original_max_position_embeddings": shape["max_position_embeddings"] // 4,
        }
        return transformers.Phi3Config(**phi3), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    if family in ("gemma3", "gemma2"):
        # the families' own defaults for norms, GeGLU, embedding scale, layer pattern and
        # soft-caps; a window shorter than transformers' 4096 default, as Gemma checkpoints have
        gemma = {**common, "tie_word_embeddings": True, "head_dim": head_dim, "pad_token_id": 0,
                 "query_pre_attn_scalar": head_dim, "sliding_window": 1024}  # fmt: skip
        if family == "gemma2":
            return transformers.Gemma2Config(**gemma), LLAMA_MODULES
        return transformers.Gemma3TextConfig(**gemma), LLAMA_MODULES
    if family in MOE:
        expert = shape["intermediate_size"] // TOP_K  # the active MLP is the Llama's
        if family == "mixtral":
            mixtral = {**common, "intermediate_size": expert, "num_local_experts": NUM_EXPERTS,
                       "num_experts_per_tok": TOP_K}  # fmt: skip
            return transformers.MixtralConfig(**mixtral), [*ATTENTION, "w1", "w2", "w3"]
        qwen = {
            **common,
            "head_dim": head_dim,
            "num_experts": NUM_EXPERTS,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": expert,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        modules = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
        return transformers.Qwen3MoeConfig(**qwen), modules
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


def write_adapter(model: Path, out: Path, modules: list[str], rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter with seeded random A and B on `modules` of every layer: a name
    matches a layer's module by its last part (`w1` matches every `experts.N.w1`), and shapes
    and keys are the adapter core's (BaseModelSpec, from config.json)."""
    spec = BaseModelSpec.from_dir(model)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in spec.layer_modules(layer):
            if module.split(".")[-1] not in modules:
                continue
            fan_in, fan_out = spec.module_shape(module)
            stem = "base_model.model." + spec.module_key(layer, module)
            a = rng.standard_normal((rank, fan_in), dtype=np.float32) * np.float32(0.05)
            b = rng.standard_normal((fan_out, rank), dtype=np.float32) * np.float32(0.05)
            tensors[f"{stem}.lora_A.weight"] = a
            tensors[f"{stem}.lora_B.weight"] = b
    if not tensors:
        raise ValueError(f"{model.name} has none of the modules {modules}")
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": modules, "bias": "none", "base_model_name_or_path": model.name,
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
