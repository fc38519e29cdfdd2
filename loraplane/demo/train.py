"""Train the demo's small base model and its tenants' LoRA adapters on CPU, in seconds, seeded.

The base model (transformers' `LlamaForCausalLM`, or another family's own class: `families.py`)
learns the plain help-desk answers of `corpus.py`; each tenant's adapter (PEFT LoRA over the
frozen base) learns its own phrasing of them. Both are written with `save_pretrained`, so the
files are exactly what a tenant would upload from their own PEFT training run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplane.adapters.base_model import SUPPORTED_MODULES
from loraplane.demo.corpus import STYLES, base_corpus, corpus
from loraplane.demo.families import FAMILIES, DemoFamily

if TYPE_CHECKING:
    import torch

Say = Callable[[str], None]
ALL_MODULES = list(SUPPORTED_MODULES)  # the seven projections of each block
LLAMA = FAMILIES["llama"]
MODEL_SHAPE: dict[str, Any] = LLAMA.shape  # the default (Llama) model's


@dataclass(frozen=True, slots=True)
class Recipe:
    """How long and how hard one training run goes."""

    steps: int
    lr: float
    log_every: int = 25

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: {self.steps} is not positive")
        if self.lr <= 0:
            raise ValueError(f"lr: {self.lr} is not positive")


BASE_RECIPE = Recipe(steps=80, lr=3e-3, log_every=20)
ADAPTER_RECIPE = Recipe(steps=80, lr=1e-2, log_every=20)


def _batch(texts: list[str], model_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and labels (-100 on padding) of `texts`, right-padded."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rows = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)  # [batch, seq]
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _fit(
    model: Any, texts: list[str], model_dir: Path, recipe: Recipe, label: str, say: Say
) -> float:
    """Full-batch AdamW on `texts`; prints the loss every `recipe.log_every` steps."""
    import torch

    ids, mask, labels = _batch(texts, model_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, recipe.steps, eta_min=recipe.lr / 10)
    model.train()
    loss_value = float("nan")
    for step in range(1, recipe.steps + 1):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        sched.step()
        loss_value = float(loss.detach())
        if step % recipe.log_every == 0 or step in (1, recipe.steps):
            say(f"      {label:<8} step {step:>4}/{recipe.steps}  loss {loss_value:.3f}")
    model.eval()
    return loss_value


def train_base(
    model_dir: Path, vocab_size: int, seed: int, say: Say, family: DemoFamily = LLAMA
) -> float:
    """Train the base model (of `family`) on the plain answers; save it into `model_dir`;
    return the loss. `model_dir` must already hold the tokenizer.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, family.config_class)(
        vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        **family.shape,
    )  # fmt: skip
    model = getattr(transformers, family.model_class)(config)
    loss = _fit(model, base_corpus(), model_dir, BASE_RECIPE, "base", say)
    model.save_pretrained(model_dir)
    return loss


def train_adapter(
    model_dir: Path, out: Path, style: str, rank: int, seed: int, say: Say, base_name: str,
    family: DemoFamily = LLAMA,
) -> float:  # fmt: skip
    """Train a PEFT LoRA adapter (what `family` targets: Llama's all seven modules) on
    `style`'s answers; save it to `out` (recording `base_name` as its base model); return the
    last loss."""
    import peft
    import torch
    import transformers

    if style not in STYLES:
        raise ValueError(f"style: unknown {style!r}")
    torch.manual_seed(seed)
    base = getattr(transformers, family.model_class).from_pretrained(model_dir)
    experts: dict[str, Any] = (
        {"target_parameters": list(family.target_parameters)} if family.target_parameters else {}
    )
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(family.target_modules),
        task_type="CAUSAL_LM", **experts,
    )  # fmt: skip
    model = peft.get_peft_model(base, config)
    loss = _fit(model, corpus(style), model_dir, ADAPTER_RECIPE, style, say)
    model.save_pretrained(str(out))
    # PEFT records the local folder it loaded the base from; name the base model instead, so
    # the adapter (and its content digest) is the same wherever the demo is built
    config_path = out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**saved, "base_model_name_or_path": base_name}, indent=2))
    return loss
