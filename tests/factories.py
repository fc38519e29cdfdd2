"""Builders for real HF-format test artefacts: tokenizers, tiny models, PEFT adapters.

Everything is built locally and seeded: no hub access (HF_HUB_OFFLINE=1). Models come from
transformers and adapters from PEFT, so tests exercise the real on-disk formats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loraplane.demo.build import build_tokenizer

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # a tiny Llama with grouped-query attention (4 heads over 2 KV heads)
    "llama": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # Qwen2: q/k/v biases, tied embeddings
    "qwen2": {
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
}


def build_model(out: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a seeded, randomly initialised HF causal LM (config, safetensors, tokenizer)."""
    import torch
    import transformers

    vocab = build_tokenizer(out)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[kind]
    shape = {**MODEL_SHAPES[kind], **overrides}
    config = config_cls(
        vocab_size=vocab, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **shape
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    return out


def build_peft_adapter(model_dir: Path, out: Path, seed: int = 0, **lora: Any) -> Path:
    """Save a PEFT LoRA adapter of the model with non-zero (random) A and B.

    `lora` goes to peft.LoraConfig (r, lora_alpha, target_modules, use_rslora, rank_pattern,
    alpha_pattern, layers_to_transform, ...).
    """
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    config = peft.LoraConfig(
        init_lora_weights=False,
        target_modules=lora.pop(
            "target_modules",
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        **lora,
    )
    model = peft.get_peft_model(base, config)
    model.save_pretrained(out)
    return out


# What transformers.Trainer (5.x) leaves in a checkpoint-* folder of a PEFT model besides the
# adapter's two files: the model card, the tokenizer (the processing_class), the trainer's
# pickles and its state.
TRAINER_EXTRAS = (
    "README.md",
    "chat_template.jinja",
    "optimizer.pt",
    "rng_state.pth",
    "scheduler.pt",
    "tokenizer.json",
    "tokenizer_config.json",
    "trainer_state.json",
    "training_args.bin",
)


def build_trainer_checkpoint(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """Train a LoRA of the model for one CPU step with transformers.Trainer; its checkpoint-1
    folder (adapter, tokenizer, training_args.bin, optimizer.pt, rng_state.pth, ...)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    rows = torch.randint(3, 50, (4, 8))
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer
    )
    trainer.train()
    return out / "checkpoint-1"
