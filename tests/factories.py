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
    # Qwen3: per-head q/k norms, head_dim 32 != 64 / 4 (q is 128 wide, k and v 64)
    "qwen3": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": False,
    },
    # Gemma 3 (text): (1 + w) norms, head_dim 32, one sliding layer (window 6) then a full one,
    # two RoPE tables, q/k norms, tied embeddings
    "gemma3_text": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"],
        "pad_token_id": 0,
    },
    # Gemma 3 as Google publishes it (Gemma3ForConditionalGeneration): this text stack under
    # model.language_model, its numbers in text_config, beside a vision tower (GEMMA3_VISION)
    "gemma3": {},  # the gemma3_text shape (set below the table)
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, partial rotary (half of each head)
    "phi3": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.5,
        "pad_token_id": 0,
    },
    # Mixtral: 4 experts, top-2 (transformers 5 packs them into 3-D parameters)
    "mixtral": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "pad_token_id": 0,
    },
    # Qwen3-MoE: 4 experts, top-2 renormalised, q/k norms, head_dim 32, layer 1 dense
    "qwen3_moe": {
        "hidden_size": 64,
        "intermediate_size": 80,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "pad_token_id": 0,
    },
}
MODEL_SHAPES["gemma3"] = dict(MODEL_SHAPES["gemma3_text"])  # its text_config
# The target modules of an adapter on every linear layer of each kind (PEFT's names); the
# mixture-of-experts kinds adapt their packed experts through FAMILY_TARGET_PARAMETERS.
FAMILY_TARGETS: dict[str, list[str]] = {
    **{
        kind: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        for kind in ("llama", "qwen2", "mistral", "qwen3", "gemma3_text", "gemma3")
    },
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
# A tiny SigLIP tower for the "gemma3" kind (never run: the text stack is what is served)
GEMMA3_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
# LoraConfig arguments an adapter of the kind needs besides its targets: the vision tower of a
# Gemma 3 checkpoint has q/k/v projections too, which the names alone would adapt
FAMILY_LORA_EXTRA: dict[str, dict[str, Any]] = {"gemma3": {"exclude_modules": ".*vision_tower.*"}}
FAMILY_TARGET_PARAMETERS: dict[str, list[str]] = {
    "mixtral": ["experts.gate_up_proj", "experts.down_proj"],
    "qwen3_moe": ["experts.gate_up_proj", "experts.down_proj"],
}


def build_model(
    out: Path, kind: str = "llama", seed: int = 0, *, spread: bool = False, **overrides: Any
) -> Path:
    """Save a seeded, randomly initialised HF causal LM (config, safetensors, tokenizer).

    `spread`: norm weights drawn from [0.5, 1.5] (HF initialises them all to one, or zero
    for Gemma's (1 + w)) and a router scaled so tokens reach every expert with clear top-k
    margins: a family's norms and routing then matter to the output."""
    import torch
    import transformers

    vocab = build_tokenizer(out)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "qwen3": transformers.Qwen3Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "gemma3": transformers.Gemma3TextConfig,
    }[kind]
    shape = {**MODEL_SHAPES[kind], **overrides}
    config = config_cls(
        vocab_size=vocab, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **shape
    )
    if kind == "gemma3":  # the text config inside a vision-language one (tokens never sent)
        config = transformers.Gemma3Config(
            text_config=config.to_dict(), vision_config=GEMMA3_VISION, mm_tokens_per_image=4,
            image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if spread:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)
                elif name.endswith("mlp.gate.weight"):  # an MoE router
                    param.normal_(0.0, 0.5)
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


def shrink_projection(adapter: Path, out: Path) -> tuple[Path, str]:
    """A copy of `adapter` whose layer-0 q_proj (or fused qkv_proj) lora_B has half the rows the
    base model's config makes it (as if head_dim were hidden / heads, or qkv_proj held q only):
    an adapter that does not fit. Returns the copy and the shrunk tensor's name."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(adapter, out)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    name = next(
        k for k in sorted(tensors)
        if ".layers.0." in k and k.endswith(("q_proj.lora_B.weight", "qkv_proj.lora_B.weight"))
    )  # fmt: skip
    tensors[name] = tensors[name][: tensors[name].shape[0] // 2].copy()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out, name


def build_family_adapter(model_dir: Path, out: Path, kind: str, seed: int = 0, r: int = 8) -> Path:
    """A PEFT adapter on every linear layer of a `kind` model (its packed experts through
    target_parameters for a mixture of experts), alpha 2r."""
    experts = FAMILY_TARGET_PARAMETERS.get(kind)
    extra: dict[str, Any] = {"target_parameters": experts} if experts else {}
    extra.update(FAMILY_LORA_EXTRA.get(kind, {}))
    return build_peft_adapter(model_dir, out, seed=seed, r=r, lora_alpha=2 * r,
                              target_modules=FAMILY_TARGETS[kind], **extra)  # fmt: skip
