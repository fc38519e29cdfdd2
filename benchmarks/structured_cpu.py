"""Structured outputs on CPU: the per-step cost of 8 JSON-schema requests in a batch of 64.

Per decode step the engine fills the 8 constrained rows' bitmasks, masks their logits, samples
the whole batch and advances the 8 matchers. The figures split that work, next to the sampler
call the same [64, V] logits need anyway (temperature 1, the sampler's costlier path).
Goal (issue 13: a step with 8 constrained requests within 10% of an unconstrained one): the
constraint's work is at most 10% of the sampler call alone, a stricter bound than the step,
which adds the model's forward pass.
Vocabularies: a byte-level BPE trained here on seeded synthetic text to 32000 tokens (no
download), and the tests' 384-token tokenizer.
Run: .venv/bin/python benchmarks/structured_cpu.py [--steps N]
(--smoke: both vocabularies, 2 steps; training the 32000-token one takes most of its seconds)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
from _common import add_smoke_flag, goal, report

from loraplane.dataplane.sampler import Sampler
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.structured import (
    Constraint,
    GrammarCompiler,
    Matcher,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from loraplane.demo.build import build_tokenizer

T = TypeVar("T")
BATCH = 64
CONSTRAINED = 8
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "tags", "color"],
    "additionalProperties": False,
}


def synthetic_corpus(lines: int, seed: int = 0) -> list[str]:
    """Pseudo-words with a long-tailed frequency, punctuation and JSON-ish separators."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiouy"] + list("aeiou")
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(60000)]
    ends = [".", ",", '": "', '", "', "\n", " {", "}", "]"]

    def word() -> str:
        if rng.random() < 0.5:
            return words[min(int(rng.paretovariate(0.6)) - 1, len(words) - 1)]
        return rng.choice(words)

    def line() -> str:
        text = " ".join(word() for _ in range(rng.randint(5, 20)))
        return text + rng.choice(ends) + str(rng.randint(0, 9999))

    return [line() for _ in range(lines)]


def tokenizer_dir(root: Path, vocab: int) -> Path:
    out = root / f"tok{vocab}"
    corpus = synthetic_corpus(80_000) if vocab > 1000 else None
    built = build_tokenizer(out, vocab_size=vocab, corpus=corpus)
    if built != vocab:
        raise RuntimeError(f"trained {built} tokens, wanted {vocab}")
    return out


def measure(tok: Path, steps: int) -> dict[str, float]:
    compiler = GrammarCompiler(tok)
    vocab = compiler.vocab_size
    start = time.perf_counter()
    grammar = compiler.compile(Constraint("json", json.dumps(SCHEMA)))
    compile_ms = (time.perf_counter() - start) * 1e3
    matchers = [Matcher(grammar) for _ in range(CONSTRAINED)]
    rows = list(range(0, BATCH, BATCH // CONSTRAINED))  # [8] spread over the batch
    row_index = torch.tensor(rows)
    bitmask = allocate_bitmask(CONSTRAINED, vocab)
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=1.0)] * BATCH
    noise = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, vocab, generator=noise)  # [64, V]

    def advance(tokens: list[int]) -> None:
        for i, (m, row) in enumerate(zip(matchers, rows, strict=True)):
            m.accept(tokens[row])
            if m.is_done:  # a finished request's row goes to a new one
                matchers[i] = Matcher(grammar)

    def fill() -> None:
        fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_one_by_one() -> None:
        for i, m in enumerate(matchers):
            m.fill_bitmask(bitmask, i)

    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        return out

    for _ in range(steps):  # a decode loop: the matchers move through the schema
        logits.copy_(torch.randn(BATCH, vocab, generator=noise))
        timed("fill_one_by_one", fill_one_by_one)
        timed("fill", fill)
        timed("mask", lambda: apply_bitmask(logits, bitmask, row_index))
        tokens = timed("sample", lambda: sampler(logits, params).token_ids)
        timed("accept", partial(advance, tokens))
    med = {k: statistics.median(v) for k, v in times.items()}
    constraint_ms = med["fill"] + med["mask"] + med["accept"]
    return {
        "compile_ms": compile_ms,
        "fill8_ms": med["fill"],
        "fill8_one_by_one_ms": med["fill_one_by_one"],
        "apply_bitmask_ms": med["mask"],
        "accept8_ms": med["accept"],
        "sampler_ms": med["sample"],
        "constraint_over_sampler": constraint_ms / med["sample"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    add_smoke_flag(parser)
    args = parser.parse_args()
    steps = 2 if args.smoke else args.steps
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in (32000, 384):
            tok = tokenizer_dir(Path(tmp), vocab)
            for key, value in measure(tok, steps).items():
                figures[f"v{vocab}_{key}"] = value
    goals = [goal(figures, "v32000_constraint_over_sampler", "<=", 0.10)]
    return report("structured_cpu", figures, goals, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
