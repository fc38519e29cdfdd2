"""Prompt log-probabilities reduced on the logits' device (prompt_logprobs.py) against a plain
torch reference (the full log_softmax of every row), in bounded slices of rows, in the engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from loraplane.dataplane import prompt_logprobs as plp
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.prompt_logprobs import PromptSpan, reduce_logits, score_prompts
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.sequence import PromptLogprob


def reference(logits: torch.Tensor, tokens: list[int], top: int) -> list[PromptLogprob]:
    """Per row: the token's log_softmax value, 1 + the number of strictly greater logits,
    and the full matrix's topk (the order the engine has always returned)."""
    logp = torch.log_softmax(logits, dim=-1)
    values, ids = logp.topk(top, dim=-1) if top else (None, None)
    out = []
    for i, token in enumerate(tokens):
        row = logits[i]
        rank = 1 + int((row > row[token]).sum())
        best = []
        if ids is not None and values is not None:
            best = list(zip(ids[i].tolist(), values[i].tolist(), strict=True))
        out.append(PromptLogprob(token, float(logp[i, token]), rank, best))
    return out


def tied_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Integer-valued logits from a small range: most values are shared by many tokens."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, (n, vocab), generator=generator).float()


def assert_same(got: list[PromptLogprob], want: list[PromptLogprob]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.token_id == w.token_id
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert g.rank == w.rank
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


def one_span(logits: torch.Tensor, tokens: list[int], top: int) -> list[PromptLogprob]:
    """The module's path end to end, with the logits themselves as the 'hidden states'."""
    scores = score_prompts([PromptSpan("r", 1, 0, tokens, top)], logits, lambda h: h)
    return scores["r"].entries()


@pytest.mark.parametrize(
    ("n", "vocab", "top", "ties"),
    [(1, 7, 0, False), (5, 384, 3, False), (9, 50, 20, True), (33, 1000, 1, True),
     (4, 16, 16, True), (300, 64, 5, False), (2, 3, 0, True)],
)  # fmt: skip
def test_reduction_equals_the_full_log_softmax_reference(
    n: int, vocab: int, top: int, ties: bool
) -> None:
    logits = tied_logits(n, vocab, seed=n) if ties else torch.randn(n, vocab) * 3
    generator = torch.Generator().manual_seed(vocab)
    tokens = torch.randint(0, vocab, (n,), generator=generator).tolist()
    if ties:  # the predicted token ties with others: they share its rank
        tokens[0] = int((logits[0] == logits[0].max()).nonzero()[-1])
    want = reference(logits, tokens, top)
    assert_same(one_span(logits, tokens, top), want)
    _, ranks, values, ids = reduce_logits(logits, torch.tensor(tokens), top)
    assert ranks.tolist() == [w.rank for w in want]
    assert values.shape == ids.shape == (n, top)
    if ties:  # the last of the tokens tied for the best logit still ranks 1
        assert ranks[0] == 1


def test_spans_of_several_requests_in_slices_of_two_rows_equal_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests with different `top` in one step, some longer than a slice: every LM head call
    covers at most ROW_SLICE rows, and each request gets exactly its own rows' scores."""
    torch.manual_seed(0)
    hidden = torch.randn(23, 16)  # [T, hidden]
    head = torch.nn.Linear(16, 97, bias=False)
    full = head(hidden).detach()  # [T, vocab]
    calls: list[int] = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return head(h).detach()

    layout = [("a", 0, 7, 3), ("b", 7, 1, 0), ("c", 8, 10, 5), ("d", 18, 5, 3)]
    tokens = {rid: [(start * 31 + j * 7) % 97 for j in range(n)] for rid, start, n, _ in layout}
    spans = [PromptSpan(rid, 4, start, tokens[rid], top) for rid, start, n, top in layout]
    monkeypatch.setattr(plp, "ROW_SLICE", 2)
    got = score_prompts(spans, hidden, compute_logits)
    assert calls and max(calls) <= 2
    assert sum(calls) == 23  # every row once, none twice
    for rid, start, n, top in layout:
        assert got[rid].first == 4
        assert got[rid].packed.shape == (n, 2 + 2 * top)  # only the reductions reach the host
        assert got[rid].packed.dtype == torch.int32
        assert_same(got[rid].entries(), reference(full[start : start + n], tokens[rid], top))
        # a recomputed prompt skips the tokens already kept
        assert_same(got[rid].entries(1), reference(full[start : start + n], tokens[rid], top)[1:])


def engine_scores(
    model_dir: Path, prompts: list[list[int]], tops: list[int], calls: list[int] | None = None
) -> list[list[PromptLogprob]]:
    """Each request's prompt log-probabilities through the engine (16-token chunks)."""
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=4,
                          num_kv_blocks=256, max_num_batched_tokens=16)  # fmt: skip
    engine = Engine(config)
    if calls is not None:
        compute: Callable[[torch.Tensor], torch.Tensor] = engine.runner.model.compute_logits

        def counted(hidden: torch.Tensor) -> torch.Tensor:
            calls.append(hidden.shape[0])
            return compute(hidden)

        engine.runner.model.compute_logits = counted  # type: ignore[method-assign]
    got: dict[str, list[PromptLogprob]] = {}
    for i, (prompt, top) in enumerate(zip(prompts, tops, strict=True)):
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=top)
        engine.add_request(f"p{i}", prompt, params)
    while engine.has_unfinished:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = out.prompt_logprobs
    return [got[f"p{i}"] for i in range(len(prompts))]


def test_engine_scores_are_the_same_when_the_lm_head_runs_two_rows_at_a_time(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prompts sharing steps: with a slice of two rows, no LM head call covers more
    than two rows and the scores equal those of one slice per step."""
    prompts = [[(7 * i + 3 * j) % 380 + 3 for j in range(29 + 5 * i)] for i in range(2)]
    tops = [4, 0]
    whole = engine_scores(tiny_llama_dir, prompts, tops)
    calls: list[int] = []
    monkeypatch.setattr(plp, "ROW_SLICE", 2)
    sliced = engine_scores(tiny_llama_dir, prompts, tops, calls)
    assert calls and max(calls) <= 2
    for got, want, prompt in zip(sliced, whole, prompts, strict=True):
        assert len(got) == len(prompt) - 1
        assert [p.token_id for p in got] == prompt[1:]
        assert_same(got, want)
