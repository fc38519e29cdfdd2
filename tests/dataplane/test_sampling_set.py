"""The sampling set (issue 13): logit_bias, min_tokens, repetition / frequency / presence
penalties, min_p, top log-probabilities, stop-string options and prompt truncation.

Each transform is checked against a reference: HF transformers' logits processors where one
exists (repetition penalty, min_p, min new tokens, sequence bias), OpenAI's formula written
out per token for frequency and presence penalties; and end to end, greedy generation in one
mixed batch over several adapters against HF+PEFT with the same transforms applied per step.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from loraplane.dataplane.detokenizer import IncrementalDetokenizer
from loraplane.dataplane.sampler import Sampler, min_p_filter, transform_logits
from loraplane.dataplane.sampling import SamplingParams
from tests.dataplane.conftest import Family, hf_logits
from tests.dataplane.test_engine import make_engine, prompts

VOCAB = 97


@dataclass
class History:
    prompt_token_ids: list[int]
    outputs: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.outputs


def reference(logits: torch.Tensor, p: SamplingParams, h: History) -> torch.Tensor:
    """One row through HF's processors and OpenAI's penalty formula, token by token."""
    row = logits.clone().unsqueeze(0)
    ids = torch.tensor([h.token_ids])
    if p.logit_bias:
        bias = {(t,): v for t, v in p.logit_bias.items()}
        row = SequenceBiasLogitsProcessor(bias)(ids, row)
    if p.min_tokens and p.stop_token_ids:
        row = MinNewTokensLengthLogitsProcessor(
            len(h.prompt_token_ids), p.min_tokens, p.stop_token_ids
        )(ids, row)
    if p.repetition_penalty != 1.0:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, row)
    for token in set(h.outputs):
        count = h.outputs.count(token)
        row[0, token] -= p.frequency_penalty * count + p.presence_penalty
    return row[0]


def random_case(rng: random.Random) -> tuple[SamplingParams, History]:
    kind = rng.choice(["bias", "min_tokens", "repetition", "frequency", "all", "none"])
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
    outputs = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))]
    settings: dict[str, object] = {"max_tokens": 32}
    if kind in ("bias", "all"):
        settings["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(3)}
    if kind in ("min_tokens", "all"):
        settings["min_tokens"] = rng.randint(0, 12)
        settings["stop_token_ids"] = [rng.randrange(VOCAB) for _ in range(2)]
    if kind in ("repetition", "all"):
        settings["repetition_penalty"] = rng.uniform(0.5, 2.0)
    if kind in ("frequency", "all"):
        settings["frequency_penalty"] = rng.uniform(-2, 2)
        settings["presence_penalty"] = rng.uniform(-2, 2)
    return SamplingParams(**settings), History(prompt, outputs)  # type: ignore[arg-type]


def test_transforms_equal_the_reference_per_row_in_one_batch() -> None:
    rng = random.Random(7)
    cases = [random_case(rng) for _ in range(48)]
    logits = torch.randn(len(cases), VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    out = transform_logits(logits.clone(), [p for p, _ in cases], [h for _, h in cases])
    for i, (p, h) in enumerate(cases):
        torch.testing.assert_close(out[i], reference(logits[i], p, h), rtol=1e-6, atol=1e-5)


def test_min_p_keeps_what_hf_min_p_keeps() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    min_ps = [0.0, 0.01, 0.1, 0.3, 0.9, 1.0]
    ours = min_p_filter(logits, min_ps)
    for i, m in enumerate(min_ps):
        theirs = MinPLogitsWarper(m)(torch.zeros(1, 1, dtype=torch.long), logits[i : i + 1])
        assert torch.equal(ours[i].isinf(), theirs[0].isinf()), m


def test_untransformed_rows_are_sampled_from_their_logits_untouched() -> None:
    """Greedy rows with and without transforms share a batch: the plain rows' choices and
    every row's log-probability (of the raw distribution) are what they would be alone."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(9))
    best = logits.argmax(dim=-1)
    plain = SamplingParams(temperature=0, logprobs=True)
    banned = SamplingParams(temperature=0, logprobs=True, logit_bias={int(best[1]): -100.0})
    params = [plain, banned, plain, banned]
    histories = [History([1, 2]) for _ in params]
    out = Sampler()(logits, params, None, histories)
    assert out.token_ids[0] == best[0] and out.token_ids[2] == best[2]
    assert out.token_ids[1] != best[1]
    raw = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(raw[i, token]), abs=1e-6)


def test_top_logprobs_are_the_best_alternatives_of_the_raw_distribution() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(11))
    params = [
        SamplingParams(temperature=0, top_logprobs=5, repetition_penalty=2.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, seed=1, logprobs=True, top_logprobs=20),
    ]
    out = Sampler()(logits, params, None, [History([4, 5]) for _ in params])
    assert out.top_logprobs is not None and out.top_logprobs[1] is None
    raw = torch.log_softmax(logits, dim=-1)
    for i, n in ((0, 5), (2, 20)):
        top = out.top_logprobs[i]
        assert top is not None and len(top) == n
        values, ids = raw[i].topk(n)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"min_tokens": 20, "max_tokens": 10},
        {"logit_bias": {5: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"top_logprobs": 21},
        {"truncate_prompt_tokens": 0},
    ],
)
def test_out_of_range_settings_are_refused_with_the_field_named(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(k for k in bad if k != "max_tokens")):
        SamplingParams(**bad)  # type: ignore[arg-type]


class Chars:
    """A tokenizer stand-in: token id i is the i-th character of ALPHABET."""

    ALPHABET = "abcdefghij .!XY"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.ALPHABET[i] for i in ids)


def feed(detok: IncrementalDetokenizer, text: str, min_chars: int = 0) -> tuple[str, bool]:
    out, stopped = "", False
    for n, ch in enumerate(text, start=1):
        delta = detok.add_token(Chars.ALPHABET.index(ch), check_stop=n >= min_chars)
        out += delta.text
        if delta.stopped:
            stopped = True
            break
    if not stopped:
        out += detok.flush().text
    return out, stopped


def test_stop_strings_can_stay_in_the_output_and_wait_for_min_tokens() -> None:
    assert feed(IncrementalDetokenizer(Chars(), stop=["XY"]), "abcXYdef") == ("abc", True)
    kept = IncrementalDetokenizer(Chars(), stop=["XY"], include_stop=True)
    assert feed(kept, "abcXYdef") == ("abcXY", True)
    # the first XY ends before min_tokens (6 tokens): it does not stop the output; the next does
    waiting = IncrementalDetokenizer(Chars(), stop=["XY"])
    assert feed(waiting, "aXYbcdXYe", min_chars=6) == ("aXYbcd", True)


def hf_step(logits: torch.Tensor, p: SamplingParams, h: History) -> int:
    return int(reference(logits, p, h).argmax())


def test_greedy_with_transforms_in_a_mixed_batch_equals_peft_token_for_token(
    families: dict[str, Family], hf_reference: Callable[[str], torch.nn.Module]
) -> None:
    family = families["llama"]
    engine, refs = make_engine(family, max_num_batched_tokens=48)
    model = hf_reference("llama")
    batch = prompts(6, seed=21)
    plain_first = int(hf_logits(model, batch[3], "r4")[-1].argmax())
    cases: list[tuple[str | None, SamplingParams]] = [
        ("r16", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                               repetition_penalty=1.8)),
        (None, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                              frequency_penalty=1.5, presence_penalty=0.5)),
        ("r64", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                               logit_bias={7: 30.0, 11: -100.0})),
        # the token greedy picks first would stop it at once: min_tokens holds it back
        ("r4", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=5,
                              stop_token_ids=[plain_first])),
        ("r16", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        ("r64", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, top_k=1,
                               repetition_penalty=1.3, presence_penalty=1.0,
                               logit_bias={5: 2.0})),
    ]  # fmt: skip
    outs = engine.generate(batch, [p for _, p in cases], [refs[n] if n else None for n, _ in cases])
    for prompt, (name, p), out in zip(batch, cases, outs, strict=True):
        h = History(list(prompt))
        while len(h.outputs) < p.max_tokens:
            token = hf_step(hf_logits(model, h.token_ids, name)[-1], p, h)
            h.outputs.append(token)
            if token in p.stop_token_ids:
                break
        assert out.token_ids == h.outputs, (name, p)
    assert len(outs[3].token_ids) >= 5 and outs[3].token_ids[0] != plain_first


def test_truncate_prompt_tokens_keeps_the_prompts_tail(families: dict[str, Family]) -> None:
    engine, refs = make_engine(families["llama"])
    prompt = prompts(1, seed=4, low=20, high=20)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cut = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=7)
    a, b = engine.generate([prompt, prompt[-7:]], [cut, greedy], [refs["r16"], refs["r16"]])
    assert a.token_ids == b.token_ids and len(a.prompt_token_ids) == 7


def test_top_logprobs_through_the_engine_equal_peft_per_adapter(
    families: dict[str, Family], hf_reference: Callable[[str], torch.nn.Module]
) -> None:
    engine, refs = make_engine(families["llama"])
    model = hf_reference("llama")
    batch = prompts(3, seed=8)
    names = ["r4", None, "r64"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, top_logprobs=3,
                            repetition_penalty=1.5)  # fmt: skip
    seqs = [engine.add_request(f"t{i}", p, params, refs[n] if n else None)
            for i, (p, n) in enumerate(zip(batch, names, strict=True))]  # fmt: skip
    tops: dict[str, list[list[tuple[int, float]]]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tops.setdefault(out.request_id, []).extend(out.top_logprobs or [])
    for i, (seq, name) in enumerate(zip(seqs, names, strict=True)):
        logp = torch.log_softmax(hf_logits(model, seq.token_ids, name), dim=-1)
        assert len(tops[f"t{i}"]) == 4
        for k, top in enumerate(tops[f"t{i}"]):
            values, ids = logp[len(seq.prompt_token_ids) - 1 + k].topk(3)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_equal_peft_per_adapter_in_a_chunked_mixed_batch(
    families: dict[str, Family], hf_reference: Callable[[str], torch.nn.Module]
) -> None:
    """Prompts are cut into chunks shared with other requests' decodes; two requests share a
    prompt (the prefix cache must not skip the positions the second one needs)."""
    engine, refs = make_engine(families["llama"], max_num_batched_tokens=16,
                               enable_prefix_caching=True)  # fmt: skip
    model = hf_reference("llama")
    batch = prompts(4, seed=31, low=12, high=30)
    batch.append(list(batch[0]))
    names = ["r16", None, "r64", "r4", "r16"]
    wants = [2, 0, 5, None, 3]
    seqs = []
    for i, (prompt, name, n) in enumerate(zip(batch, names, wants, strict=True)):
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=n)
        seqs.append(engine.add_request(f"p{i}", prompt, params, refs[name] if name else None))
    first: dict[str, object] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in first  # sent once, with the first token
                first[out.request_id] = out.prompt_logprobs
    assert "p3" not in first
    for seq, name, n in zip(seqs, names, wants, strict=True):
        if n is None:
            continue
        got = first[seq.request_id]
        assert isinstance(got, list) and len(got) == len(seq.prompt_token_ids) - 1
        logp = torch.log_softmax(hf_logits(model, seq.prompt_token_ids, name), dim=-1)
        for pos, entry in enumerate(got, start=1):
            row = logp[pos - 1]
            token = seq.prompt_token_ids[pos]
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert entry.rank == int((row > row[token]).sum()) + 1
            values, ids = row.topk(n) if n else (torch.empty(0), torch.empty(0))
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
