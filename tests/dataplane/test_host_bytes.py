"""What crosses from the logits' device to the host per engine step: the tokens and the
log-probabilities the requests asked for, in one copy, never a row of logits.

The budget of a step, in bytes, over the rows that sample in it:

    budget = sum over rows of (8                                  # the chosen token id
                               + 4 if the row's request wants logprobs  # the chosen token's
                               + 12 * top_logprobs)               # per alternative: id and value

(the sampler packs int32 words, so it sends 4 + 4 + 8 * top_logprobs; the budget is the issue's
ceiling). The count is `HostCopy.bytes`, the counter of the one helper every device->host copy
of the step goes through; besides it, no `.cpu()` / `.tolist()` / `.item()` / `.numpy()` of a
logits-shaped tensor (last dimension the vocabulary) may happen during a step, and inside the
sampler none of any tensor but what its one copy brought back (on a GPU, each would be a sync).
The negative controls put back main's paths (the full logits to the host, the tokens read back
on their own) and show that the checks catch them.

The engine runs on CPU here, as a stand-in for the device path; the sampler's CPU-only ways
are turned off (`sampler.CANDIDATES` 0: the top-k / top-p branch that reads each row's choice
of path on the host, as on CPU it may, there being no device; `INVERSE_CDF_ON_CPU` False), so
that the path a GPU takes is the one checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplane.dataplane import sampler
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.host_copy import HostCopy, to_device, to_host
from loraplane.dataplane.model_runner import StepLogits
from loraplane.dataplane.sampler import Sampler, make_generator
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.scheduler import SchedulerOutput
from loraplane.dataplane.structured import Constraint

ROWS = 3
PROMPTS = [[5, 9, 13, 21], [34, 55, 89], [144, 233, 7, 11, 2]]


def budget(params: SamplingParams) -> int:
    """The bytes one sampling row of a request with `params` may move (module docstring)."""
    return 8 + (4 if params.wants_logprobs else 0) + 12 * params.top_logprobs


@dataclass
class Step:
    decode: bool  # every row of the step was a decode row
    rows: int  # rows that sampled
    moved: int  # device->host bytes counted by the runner's HostCopy
    copies: int
    budget: int


@dataclass
class Watch:
    """Records every host read of a logits-shaped tensor while armed, and inside the sampler
    every read of a tensor other than what its one copy brought back (on a GPU each such read
    would be a sync of its own)."""

    vocab: int
    armed: bool = False
    reads: list[str] = field(default_factory=list)
    in_sampler: bool = False  # inside Sampler.__call__, outside its HostCopy
    copied: set[int] = field(default_factory=set)  # storages the HostCopy returned
    sampler_reads: list[str] = field(default_factory=list)


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Watch]:
    monkeypatch.setattr(sampler, "CANDIDATES", 0)  # the device path (module docstring)
    monkeypatch.setattr(sampler, "INVERSE_CDF_ON_CPU", False)
    w = Watch(vocab=0)
    for name in ("cpu", "tolist", "item", "numpy"):
        original = getattr(torch.Tensor, name)

        def hooked(
            self: torch.Tensor, *a: Any, _n: str = name, _f: Any = original, **k: Any
        ) -> Any:
            if w.armed and self.dim() >= 1 and self.shape[-1] == w.vocab:
                w.reads.append(f"{_n} of {tuple(self.shape)}")
            if w.in_sampler and self.untyped_storage().data_ptr() not in w.copied:
                w.sampler_reads.append(f"{_n} of {tuple(self.shape)}")
            return _f(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, hooked)
    yield w
    w.armed = False


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                               num_kv_blocks=64, block_size=4))  # fmt: skip


def run_steps(engine: Engine, params: list[SamplingParams], watch: Watch) -> list[Step]:
    """Serve one request per params to the end; per step, what crossed to the host."""
    counter = engine.runner.host_copy
    execute = engine.runner.execute
    steps: list[Step] = []

    def measured(out: SchedulerOutput, *args: Any, **kwargs: Any) -> StepLogits:
        decode = all(r.start >= r.seq.num_prompt_tokens for r in out.scheduled)
        rows = [r.seq.params for r in out.sampled]
        steps.append(Step(decode, len(rows), -counter.bytes, -counter.copies,
                          sum(budget(p) for p in rows)))  # fmt: skip
        return execute(out, *args, **kwargs)

    sampler = engine.sampler
    copy = sampler.host_copy

    def watched_copy(packed: torch.Tensor) -> torch.Tensor:
        watch.in_sampler = False
        host = copy(packed)
        watch.copied.add(host.untyped_storage().data_ptr())
        watch.in_sampler = True
        return host

    def watched_sampler(*args: Any, **kwargs: Any) -> Any:
        watch.in_sampler = True
        try:
            return sampler(*args, **kwargs)
        finally:
            watch.in_sampler = False
            watch.copied.clear()

    engine.runner.execute = measured  # type: ignore[method-assign]
    sampler.host_copy = watched_copy  # type: ignore[assignment]
    engine.sampler = watched_sampler  # type: ignore[assignment]
    watch.vocab = engine.runner.vocab_size
    try:
        for i, p in enumerate(params):
            engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], p)
        watch.armed = True
        while engine.has_unfinished:
            before = len(steps)
            engine.step()
            if len(steps) > before:  # the step's copies are done once step() returns
                steps[-1].moved += counter.bytes
                steps[-1].copies += counter.copies
    finally:
        watch.armed = False
        engine.runner.execute = execute  # type: ignore[method-assign]
        sampler.host_copy, engine.sampler = copy, sampler
    return steps


def _settings(engine: Engine) -> dict[str, list[SamplingParams]]:
    def each(**kw: Any) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=5, ignore_eos=True, **kw) for _ in range(ROWS)]

    grammar = engine.grammars().compile(Constraint("regex", "[a-z]{8,20}"))
    mixed = [
        SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8, top_logprobs=5),
        SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=5, ignore_eos=True, top_p=0.9, seed=3),
    ]
    return {
        "greedy": each(temperature=0),
        "temperature": each(temperature=0.7),
        "top_k": each(top_k=5),
        "top_p": each(top_p=0.8),
        "min_p": each(min_p=0.1),
        "penalties": each(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
        "logit_bias": each(logit_bias={7: 5.0, 11: -100.0}),
        "min_tokens": each(min_tokens=3, stop_token_ids=[2]),
        "seeded": [SamplingParams(max_tokens=5, ignore_eos=True, seed=i) for i in range(ROWS)],
        "structured": each(grammar=grammar),
        "logprobs": each(logprobs=True),
        "top_logprobs_5": each(logprobs=True, top_logprobs=5),
        "mixed": mixed,
    }


SETTINGS = ["greedy", "temperature", "top_k", "top_p", "min_p", "penalties", "logit_bias",
            "min_tokens", "seeded", "structured", "logprobs", "top_logprobs_5",
            "mixed"]  # fmt: skip


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_step_moves_only_the_tokens_and_the_logprobs_asked_for(
    engine: Engine, watch: Watch, setting: str
) -> None:
    settings = _settings(engine)
    assert set(settings) == set(SETTINGS)
    steps = run_steps(engine, settings[setting], watch)
    decodes = [s for s in steps if s.decode]
    assert len(decodes) >= 3  # max_tokens=5: the first token from the prefill, then decodes
    for s in steps:
        assert s.moved <= s.budget, s
        assert s.copies == (1 if s.rows else 0), s  # one copy per step, not per request
    assert all(d.rows == ROWS and d.moved >= 4 * ROWS for d in decodes)
    assert watch.reads == []  # no logits row was read on the host
    assert watch.sampler_reads == []  # the sampler read back only its one copy


def test_prompt_logprobs_of_several_requests_take_one_copy_per_step(
    engine: Engine, watch: Watch
) -> None:
    params = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=k) for k in (0, 2, 2)]
    steps = run_steps(engine, params, watch)
    first = steps[0]
    assert first.rows == ROWS and not first.decode
    scored = sum(len(p) - 1 for p in PROMPTS)  # every prompt token after the first
    widths = [2, 6, 6]  # int32 words per scored token: logprob, rank, then 2 * k
    expected = 4 * sum((len(p) - 1) * w for p, w in zip(PROMPTS, widths, strict=True))
    assert scored == 9
    # the prompt scores of the three requests in one copy, the sampler's tokens in another
    assert first.copies == 2
    assert first.moved == expected + 4 * ROWS
    assert watch.reads == []


# --- negative controls: the old path (the full logits to the host) is caught ---


def test_the_checks_catch_the_full_logits_crossing_to_the_host(
    engine: Engine, watch: Watch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As main did: `execute` ends with `sampled.cpu()`; and the same bytes through the counted
    copy. The first is seen by the host-read watch, the second by the budget."""
    execute = engine.runner.execute

    def old(out: SchedulerOutput, *args: Any, **kwargs: Any) -> StepLogits:
        logits = execute(out, *args, **kwargs)
        return StepLogits(logits.sampled.cpu(), logits.prompt)

    monkeypatch.setattr(engine.runner, "execute", old)
    params = _settings(engine)["temperature"]
    run_steps(engine, params, watch)
    assert watch.reads and all(r.startswith("cpu of (") for r in watch.reads)

    watch.reads.clear()

    def counted(out: SchedulerOutput, *args: Any, **kwargs: Any) -> StepLogits:
        logits = execute(out, *args, **kwargs)
        return StepLogits(engine.runner.host_copy(logits.sampled), logits.prompt)

    monkeypatch.setattr(engine.runner, "execute", counted)
    steps = run_steps(engine, params, watch)
    assert all(s.moved > s.budget for s in steps if s.rows)


def test_the_checks_catch_a_read_back_inside_the_sampler(
    engine: Engine, watch: Watch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As main's sampler did: the chosen tokens read back with their own `.tolist()`."""
    results = Sampler._results

    def old(self: Sampler, raw: torch.Tensor, tokens: torch.Tensor, params: Any) -> Any:
        tokens.tolist()
        return results(self, raw, tokens, params)

    monkeypatch.setattr(Sampler, "_results", old)
    run_steps(engine, _settings(engine)["greedy"], watch)
    assert watch.sampler_reads and watch.reads == []


# --- the helper itself ---


def test_host_copy_counts_the_bytes_of_each_copy() -> None:
    counter = HostCopy()
    packed = torch.arange(6, dtype=torch.int32)
    host = counter(packed)
    assert host.device.type == "cpu" and host.tolist() == list(range(6))
    assert (counter.bytes, counter.copies) == (24, 1)
    counter(torch.zeros(2, 3, dtype=torch.float64))
    assert (counter.bytes, counter.copies) == (72, 2)
    assert to_host(packed) is packed  # already on the host: no copy


def test_to_device_makes_the_dtype_asked_for() -> None:
    cpu = torch.device("cpu")
    assert to_device([1, 2], torch.long, cpu).dtype == torch.long
    assert to_device([0.5], torch.float32, cpu).tolist() == [0.5]
    assert to_device(torch.tensor([3, 4]), torch.int32, cpu).dtype == torch.int32


def test_the_sampler_sends_only_the_alternatives_each_row_asked_for() -> None:
    counter = HostCopy()
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=k) for k in (5, 0, 2)]
    params.append(SamplingParams(temperature=0))
    out = Sampler(host_copy=counter)(logits, params)
    assert counter.copies == 1
    assert counter.bytes == 4 * 4 + 4 * 3 + 8 * (5 + 0 + 2)
    assert out.top_logprobs is not None
    assert [None if t is None else len(t) for t in out.top_logprobs] == [5, 0, 2, None]
    reference = torch.log_softmax(logits, dim=-1)
    for i, k in ((0, 5), (2, 2)):
        values, ids = reference[i].topk(k)
        got = out.top_logprobs[i]
        assert got is not None
        assert [t for t, _ in got] == ids.tolist()
        assert [v for _, v in got] == pytest.approx(values.tolist(), abs=1e-6)


# --- on a GPU: the sampler and its generators on the logits' device ---

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@CUDA
def test_on_cuda_the_sampler_draws_on_the_device_and_seeded_rows_ignore_the_batch() -> None:
    device = torch.device("cuda")
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1)).to(device)
    greedy = Sampler(device=device)(logits, [SamplingParams(temperature=0)] * 6)
    assert greedy.token_ids == logits.argmax(dim=-1).tolist()
    params = SamplingParams(top_p=0.9, top_k=50, seed=7, logprobs=True, top_logprobs=3)

    def seeded_row(batch: int, row: int) -> list[int]:
        sampler = Sampler(seed=batch, device=device)
        gen = make_generator(7, device)
        tokens = []
        for step in range(5):
            x = torch.randn(batch, 1000, device=device)
            x[row] = logits[step % 6]
            ps = [SamplingParams(temperature=0.9)] * batch
            ps[row] = params
            gens: list[torch.Generator | None] = [None] * batch
            gens[row] = gen
            tokens.append(sampler(x, ps, gens).token_ids[row])
        return tokens

    assert seeded_row(1, 0) == seeded_row(7, 4)
