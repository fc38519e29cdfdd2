"""Data plane fixtures: Qwen2- and Mistral-style models with adapters, HF+PEFT references, and a
small paged runner that drives the model the way the engine's model runner does."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.attention import AttentionMetadata, query_positions
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora import LoRABatch, LoRAPool, install_lora, load_lora
from loraplane.dataplane.models import LlamaForCausalLM, load_model
from tests.conftest import ADAPTER_CONFIGS


@dataclass
class Family:
    """A base model directory and its PEFT adapters (name -> folder)."""

    kind: str
    model_dir: Path
    adapters: dict[str, Path]


def _perturb(model_dir: Path, seed: int) -> None:
    """Give biases and norm weights random values (HF initialises them to 0 and 1)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(model_dir)


def _build_family(kind: str, root: Path, **overrides: Any) -> Family:
    from tests.factories import build_model, build_peft_adapter

    model_dir = build_model(root / kind, kind, **overrides)
    _perturb(model_dir, seed=7)
    adapters = {
        name: build_peft_adapter(model_dir, root / f"{kind}-{name}", seed=100 + i, **dict(cfg))
        for i, (name, cfg) in enumerate(ADAPTER_CONFIGS.items())
    }
    return Family(kind, model_dir, adapters)


@pytest.fixture(scope="session")
def families(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Family]:
    """llama (the shared tiny model), qwen2 (q/k/v bias, tied embeddings, 4 heads over 1 KV
    head) and mistral (8 heads over 2 KV heads, an 8-token sliding window), each with every
    ADAPTER_CONFIGS adapter."""
    root = tmp_path_factory.mktemp("dataplane-models")
    return {
        "llama": Family("llama", tiny_llama_dir, peft_adapters),
        "qwen2": _build_family("qwen2", root),
        "mistral": _build_family("mistral", root, sliding_window=8),
    }


@pytest.fixture(scope="session")
def hf_reference(families: dict[str, Family]) -> Callable[[str], torch.nn.Module]:
    """kind -> a PeftModel of that family's base model with all its adapters loaded (fp32)."""
    import peft
    import transformers

    cache: dict[str, torch.nn.Module] = {}

    def get(kind: str) -> torch.nn.Module:
        if kind not in cache:
            fam = families[kind]
            base = transformers.AutoModelForCausalLM.from_pretrained(fam.model_dir)
            names = list(fam.adapters)
            model = peft.PeftModel.from_pretrained(
                base, fam.adapters[names[0]], adapter_name=names[0]
            )
            for name in names[1:]:
                model.load_adapter(fam.adapters[name], adapter_name=name)
            cache[kind] = model.eval()
        return cache[kind]

    return get


def hf_logits(reference: torch.nn.Module, tokens: list[int], adapter: str | None) -> torch.Tensor:
    """HF+PEFT fp32 logits [len(tokens), vocab] of one sequence (adapter None: base model)."""
    with torch.no_grad():
        out = reference(torch.tensor([tokens]), adapter_names=[adapter or "__base__"])
    logits: torch.Tensor = out.logits[0]
    return logits.float()


@dataclass
class LoadedModel:
    """Our model with LoRA installed and every adapter of the family in its own slot."""

    model: LlamaForCausalLM
    pool: LoRAPool
    slots: dict[str, int]


@pytest.fixture(scope="session")
def loaded_models(families: dict[str, Family]) -> Callable[[str], LoadedModel]:
    """kind -> LoadedModel (fp32, CPU), built once per session."""
    cache: dict[str, LoadedModel] = {}

    def get(kind: str) -> LoadedModel:
        if kind not in cache:
            fam = families[kind]
            spec = BaseModelSpec.from_dir(fam.model_dir)
            model = load_model(fam.model_dir, torch.float32, torch.device("cpu"))
            layout = dispatch.b_transposed(torch.float32, torch.device("cpu"))  # the engine's
            pool = LoRAPool(len(fam.adapters), spec, torch.float32, "cpu", b_transposed=layout)
            install_lora(model, pool)
            slots = {}
            for slot, (name, path) in enumerate(fam.adapters.items()):
                pool.load(slot, load_lora(path, spec))
                slots[name] = slot
            cache[kind] = LoadedModel(model, pool, slots)
        return cache[kind]

    return get


@dataclass
class Seq:
    """One request as the runner tracks it: its tokens, adapter slot and blocks."""

    tokens: list[int]
    slot: int = -1
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] per computed position
    first_logit: int = 0  # position of logits[0] (> 0 after a cached prefix)


class PagedRunner:
    """Drives a model like the engine's runner: block tables from a shuffled free list,
    one flat batch per step, a LoRABatch per step."""

    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        model.allocate_kv_cache(num_blocks, block_size)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def share_prefix(self, source: Seq, target: Seq, num_blocks: int) -> None:
        """Let `target` start from `source`'s first full blocks (prefix caching)."""
        target.blocks = list(source.blocks[:num_blocks])
        target.num_computed = target.first_logit = num_blocks * self.block_size

    def step(self, work: list[tuple[Seq, int]]) -> None:
        """Compute `n` new tokens of each (seq, n); append each position's logits to seq."""
        q_lens, ctx_lens, tables, ids, slots = [], [], [], [], []
        for seq, n in work:
            ctx = seq.num_computed + n
            while len(seq.blocks) * self.block_size < ctx:
                seq.blocks.append(self.free.pop())
            q_lens.append(n)
            ctx_lens.append(ctx)
            tables.append(seq.blocks)
            ids.extend(seq.tokens[seq.num_computed : ctx])
            slots.extend([seq.slot] * n)
        attn = AttentionMetadata.build(q_lens, ctx_lens, tables, self.block_size)
        lora = LoRABatch.from_token_slots(slots)
        hidden = self.model(torch.tensor(ids), query_positions(q_lens, ctx_lens), attn, lora)
        logits = self.model.compute_logits(hidden)
        offset = 0
        for seq, n in work:
            seq.logits.extend(logits[offset : offset + n])
            seq.num_computed += n
            offset += n


def compile_without_gpu(script: str, timeout: float) -> str:
    """Run `script` (Triton compiles for a GPU target) in a fresh interpreter without
    TRITON_INTERPRET; its stdout. Skips when Triton's NVIDIA backend or ptxas is missing."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
