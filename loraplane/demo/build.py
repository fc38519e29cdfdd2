"""Build small HF-format artefacts locally with numpy: a tokenizer, a Llama model, adapters.

Seeded random weights, without transformers: these writers produce the same files
`save_pretrained` would (config.json, model.safetensors, tokenizer.json, adapter_config.json,
adapter_model.safetensors). Tests and benchmarks use them; the demo trains its model and
adapters instead (`train.py`), and uses `build_tokenizer` and, for a rank-too-large upload,
`build_adapter`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from loraplane.adapters.base_model import SUPPORTED_MODULES, BaseModelSpec, read_config

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Many tenants share one base model; each brings a small LoRA adapter.",
    "LoRA adds a low-rank update B(A x) to a frozen linear layer W x.",
    "Grüße aus Zürich! 東京 and naïve café: unicode must survive detokenisation.",
    "def add(a, b):\n    return a + b\n",
    "Serving 100 adapters from one GPU needs mixed batches and fast kernels.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 384, corpus: list[str] | None = None) -> int:
    """Train a byte-level BPE; write tokenizer.json and tokenizer_config.json; return vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or CORPUS) * 4, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return int(tok.get_vocab_size())


def llama_config(vocab_size: int, **shape: Any) -> dict[str, Any]:
    """An HF LlamaForCausalLM config.json; `shape` overrides the small defaults."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    config.update(shape)
    return config


def module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable linear layer."""
    spec = BaseModelSpec.from_config(config, "model")
    return {m: spec.module_shape(m) for m in SUPPORTED_MODULES}


def build_llama(out: Path, seed: int = 0, **shape: Any) -> Path:
    """Write a seeded random Llama model directory (config, weights, tokenizer, generation).

    `shape` overrides config fields; a `vocab_size` above the tokenizer's pads the embedding.
    """
    vocab = max(build_tokenizer(out), shape.pop("vocab_size", 0))
    config = llama_config(vocab, **shape)
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    spec = BaseModelSpec.from_config(config, out.name)

    def init(rows: int, cols: int) -> np.ndarray[Any, Any]:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)

    tensors = {
        "model.embed_tokens.weight": init(vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": init(vocab, hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in module_shapes(config).items():
            key = spec.module_key(layer, module)
            tensors[f"{key}.weight"] = init(fan_out, fan_in)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = np.ones(hidden, np.float32)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2)
    )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_adapter(
    model_dir: Path,
    out: Path,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: list[str] | None = None,
    seed: int = 0,
    std: float = 0.05,
) -> Path:
    """Write a PEFT-format LoRA adapter with seeded random A and B for every layer."""
    config = read_config(str(model_dir))
    spec = BaseModelSpec.from_config(config, model_dir.name)
    targets = target_modules or list(SUPPORTED_MODULES)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in module_shapes(config).items():
            if module not in targets:
                continue
            stem = "base_model.model." + spec.module_key(layer, module)
            a = rng.standard_normal((r, fan_in)) * std
            b = rng.standard_normal((fan_out, r)) * std
            tensors[f"{stem}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = b.astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": lora_alpha,
        "target_modules": targets,
        "bias": "none",
        "base_model_name_or_path": model_dir.name,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
