"""Shared HF + PEFT parity scenario for the decoder families beyond Llama (Qwen3, Phi-3).

One mixed run per family: several adapters of different ranks and targets plus base rows in
one batch, a prompt prefilled in two chunks while others decode, a request starting from
another's cached prefix blocks, and greedy decode steps. Every computed position's logits are
compared with HF + PEFT's full forward of the same tokens, and every greedy token with HF's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.kernels import dispatch
from loraplane.dataplane.lora import LoRAPool, install_lora, load_lora
from loraplane.dataplane.models import LlamaForCausalLM, load_model
from tests.dataplane.conftest import PagedRunner, Seq, _perturb, hf_logits

ATOL = 1e-4  # the Llama parity tests' tolerance (fp32, CPU)


def build_base(out: Path, config_cls: Any, seed: int = 0, **shape: Any) -> Path:
    """A seeded HF model of `config_cls` with the tokenizer, norms and biases perturbed."""
    import transformers

    from loraplane.demo.build import build_tokenizer

    vocab = build_tokenizer(out)
    config = config_cls(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    _perturb(out, seed=seed + 7)
    return out


@dataclass
class Served:
    """Our model with every adapter in a slot, and HF + PEFT with the same adapters."""

    model: LlamaForCausalLM
    slots: dict[str, int]
    reference: torch.nn.Module
    model_dir: Path
    adapters: dict[str, Path]


def serve(model_dir: Path, adapters: dict[str, Path]) -> Served:
    """Load the base into the engine's decoder with a LoRA pool, and the HF + PEFT reference."""
    import peft
    import transformers

    spec = BaseModelSpec.from_dir(model_dir)
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    layout = dispatch.b_transposed(torch.float32, torch.device("cpu"))  # the engine's
    pool = LoRAPool(len(adapters), spec, torch.float32, "cpu", b_transposed=layout)
    install_lora(model, pool)
    slots = {}
    for slot, (name, path) in enumerate(adapters.items()):
        pool.load(slot, load_lora(path, spec))
        slots[name] = slot
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    names = list(adapters)
    reference = peft.PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        reference.load_adapter(adapters[name], adapter_name=name)
    return Served(model, slots, reference.eval(), model_dir, adapters)


def check(seq: Seq, reference: torch.nn.Module, adapter: str | None) -> None:
    """seq's logits equal HF + PEFT's at every position it computed, and so do greedy tokens."""
    expected = hf_logits(reference, seq.tokens[: seq.num_computed], adapter)[seq.first_logit :]
    got = torch.stack(seq.logits)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(length)]


def mixed_run(
    served: Served,
    names: list[str | None],
    lengths: list[int],
    seed: int,
    decode_steps: int = 4,
    sharer_tail: int = 5,
) -> list[tuple[Seq, str | None]]:
    """The mixed scenario over `names` (None: base rows); returns each sequence and its adapter.

    Step 1 prefills every prompt but the last whole and the last one's first half (chunked
    prefill); step 2 adds a request sharing the first prompt's first two blocks (prefix cache,
    its first step attends to blocks it did not write) while the others decode and the last
    prompt finishes; then everyone decodes greedily."""
    rng = random.Random(seed)
    seqs = [
        Seq(prompt(rng, n), served.slots[a] if a else -1)
        for a, n in zip(names, lengths, strict=True)
    ]
    runner = PagedRunner(served.model, num_blocks=128, block_size=4, seed=seed)
    chunked = seqs[-1]
    first_chunk = len(chunked.tokens) // 2
    runner.step([(s, len(s.tokens)) for s in seqs[:-1]] + [(chunked, first_chunk)])
    writer, writer_name = seqs[0], names[0]
    assert writer.num_computed >= 8, "the first prompt must fill two blocks of 4"
    sharer = Seq([*writer.tokens[:8], *prompt(rng, sharer_tail)], writer.slot)
    runner.share_prefix(writer, sharer, 2)
    everyone = [*seqs, sharer]
    for _ in range(decode_steps + 1):
        for seq in everyone:
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(int(seq.logits[-1].argmax()))
        runner.step([(s, len(s.tokens) - s.num_computed) for s in everyone])
    return [*zip(seqs, names, strict=True), (sharer, writer_name)]


def engine_greedy_equals_hf(
    served: Served, names: list[str | None], prompt_lens: list[int]
) -> None:
    """The whole engine (scheduler, chunked prefill under a small token budget, prefix cache,
    LoRA tiers) generates HF + PEFT's greedy tokens for a mixed batch."""
    from loraplane.dataplane.config import EngineConfig
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sampling import SamplingParams

    engine = Engine(
        EngineConfig(
            model=str(served.model_dir), device="cpu", dtype="float32", block_size=4,
            max_loras=len(served.adapters), num_kv_blocks=256, max_num_batched_tokens=24,
        )
    )  # fmt: skip
    refs = {name: engine.register_lora(name, path, "t") for name, path in served.adapters.items()}
    rng = random.Random(5)
    prompts = [prompt(rng, n) for n in prompt_lens]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = engine.generate(prompts, greedy, [refs[n] if n else None for n in names])
    for tokens, name, out in zip(prompts, names, outs, strict=True):
        expected = list(tokens)
        for _ in range(8):
            expected.append(int(hf_logits(served.reference, expected, name)[-1].argmax()))
        assert out.token_ids == expected[len(tokens) :], name
