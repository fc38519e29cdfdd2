"""Sampler and SamplingParams: greedy, filters, per-request seeds, logprobs, validation."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

from loraplane.dataplane import sampler as sampler_module
from loraplane.dataplane.sampler import Sampler, make_generator
from loraplane.dataplane.sampling import SamplingParams

V = 50


def logits(batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, V, generator=g) * 3  # [B, V]


def test_greedy_is_argmax() -> None:
    x = logits(6)
    out = Sampler()(x, [SamplingParams(temperature=0)] * 6)
    assert out.token_ids == x.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    x = logits(8, seed=1)
    sampler = Sampler(seed=3)
    expected = x.argmax(dim=-1).tolist()
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(top_p=1e-6)):
        for _ in range(5):
            assert sampler(x, [params] * 8).token_ids == expected


def test_top_k_samples_only_among_the_k_best() -> None:
    x = logits(1, seed=2).expand(2000, V).contiguous()
    out = Sampler(seed=4)(x, [SamplingParams(temperature=5.0, top_k=3)] * 2000)
    allowed = set(x[0].topk(3).indices.tolist())
    assert set(out.token_ids) == allowed  # all three seen with a high temperature, no others


def test_top_p_samples_only_inside_the_nucleus() -> None:
    row = torch.full((V,), -10.0)
    row[[3, 7, 9]] = torch.tensor([2.0, 1.5, 1.0])  # ~0.50, 0.30, 0.18 of the mass
    x = row.expand(2000, V).contiguous()
    out = Sampler(seed=5)(x, [SamplingParams(top_p=0.7)] * 2000)
    assert set(out.token_ids) == {3, 7}  # 0.50 + 0.30 reach 0.7; 9 is outside


def test_temperature_sampling_follows_the_softmax_distribution() -> None:
    row = torch.tensor([1.0, 0.0, -1.0] + [-30.0] * (V - 3))
    x = row.expand(20000, V).contiguous()
    out = Sampler(seed=6)(x, [SamplingParams(temperature=2.0)] * 20000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=V)[:3].float() / 20000
    expected = torch.softmax(row / 2.0, dim=-1)[:3]
    assert torch.allclose(freq, expected, atol=0.015)


def _seeded_row(
    params: SamplingParams, other: SamplingParams, steps: list[torch.Tensor],
    batch_logits: Callable[[int, int], torch.Tensor], batch: int, row: int,
) -> list[int]:  # fmt: skip
    """The tokens of a seeded request (`params`, its logits per step `steps`) at `row` of a
    batch of `batch` rows, the others' logits batch_logits(step, batch) sampled with `other`."""
    sampler = Sampler(seed=batch)  # unseeded rows draw from a different stream each time
    gen = make_generator(params.seed or 0)
    tokens = []
    for i, mine in enumerate(steps):
        x = batch_logits(i, batch)
        x[row] = mine
        ps = [other] * batch
        ps[row] = params
        gens: list[torch.Generator | None] = [None] * batch
        gens[row] = gen
        tokens.append(sampler(x, ps, gens).token_ids[row])
    return tokens


def test_a_seeded_request_gives_the_same_tokens_alone_or_in_any_batch() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    steps = [logits(1, seed=100 + i)[0] for i in range(10)]  # the seeded row's logits per step
    run = partial(_seeded_row, params, SamplingParams(temperature=0.8), steps,
                  lambda i, batch: logits(batch, seed=200 + i + batch))  # fmt: skip
    alone = run(1, 0)
    assert run(5, 3) == alone
    assert run(9, 0) == alone
    assert len(set(alone)) > 1  # really sampled, not argmax


BIG = 5000  # a vocabulary well past sampler.CANDIDATES


def _peaky(seed: int) -> torch.Tensor:
    """A trained model's kind of row: a few hundred tokens hold nearly all the mass."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(BIG, generator=g) - 12.0
    row[torch.randperm(BIG, generator=g)[:40]] = torch.randn(40, generator=g) * 2
    return row


def _nucleus(row: torch.Tensor, top_p: float, top_k: int = -1) -> dict[int, float]:
    """The full sort's kept tokens and their renormalised probabilities (the reference)."""
    ordered, order = row.sort(descending=True)
    if top_k != -1:
        ordered, order = ordered[:top_k], order[:top_k]
    probs = torch.softmax(ordered.double(), dim=-1)
    kept = (probs.cumsum(0) - probs) < top_p
    mass = probs[kept] / probs[kept].sum()
    return dict(zip(order[kept].tolist(), mass.tolist(), strict=True))


def _full_sorts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the rows that take the full-vocabulary sort (`_top_k_top_p`)."""
    rows: list[int] = []
    inner = sampler_module._top_k_top_p

    def counted(logits: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(logits.shape[0])
        return inner(logits, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler_module, "_top_k_top_p", counted)
    return rows


def test_top_p_on_a_peaky_row_draws_among_the_candidates_with_the_nucleus_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU a row whose nucleus lies within its best CANDIDATES skips the sort, and its
    tokens follow the nucleus's renormalised probabilities."""
    sorts = _full_sorts(monkeypatch)
    row = _peaky(11)
    want = _nucleus(row, 0.9)
    assert 2 < len(want) < sampler_module.CANDIDATES
    n = 20000
    out = Sampler(seed=12)(row.expand(n, BIG).contiguous(), [SamplingParams(top_p=0.9)] * n)
    assert sorts == []
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=BIG).double() / n
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(want)
    for token, p in want.items():
        assert counts[token].item() == pytest.approx(p, abs=0.015)


def test_a_flat_row_takes_the_full_sort_and_stays_inside_its_nucleus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row whose candidates do not reach its top_p (a flat distribution) is sampled over the
    whole sorted vocabulary, in the same batch as a peaky row that is not."""
    sorts = _full_sorts(monkeypatch)
    flat = torch.randn(BIG, generator=torch.Generator().manual_seed(13)) * 0.5
    peaky = _peaky(14)
    n = 400
    x = torch.stack([flat, peaky] * n)
    out = Sampler(seed=15)(x, [SamplingParams(top_p=0.9)] * (2 * n))
    assert sorts == [n]  # the flat rows only, in one call
    flat_tokens, peaky_tokens = set(out.token_ids[0::2]), set(out.token_ids[1::2])
    assert flat_tokens <= set(_nucleus(flat, 0.9)) and len(flat_tokens) > 300
    assert peaky_tokens <= set(_nucleus(peaky, 0.9))


def test_top_k_within_max_candidates_never_sorts_even_on_a_flat_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sorts = _full_sorts(monkeypatch)
    flat = torch.randn(BIG, generator=torch.Generator().manual_seed(16))
    n = 3000
    params = [SamplingParams(temperature=3.0, top_k=300, top_p=0.95)] * n
    out = Sampler(seed=17)(flat.expand(n, BIG).contiguous(), params)
    assert sorts == []
    want = set(_nucleus(flat / 3.0, 0.95, top_k=300))
    assert set(out.token_ids) <= want and len(set(out.token_ids)) > 200


def test_the_candidates_and_the_full_sort_draw_the_same_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same peaky rows with top_k and top_p, sampled on the candidates and (CANDIDATES 0)
    through the full sort: the frequencies agree with each other and with the reference."""
    row = _peaky(18)
    params = [SamplingParams(temperature=1.3, top_k=30, top_p=0.8)] * 20000
    x = row.expand(len(params), BIG).contiguous()
    want = _nucleus(row / 1.3, 0.8, top_k=30)
    freqs = []
    for candidates in (sampler_module.CANDIDATES, 0):
        monkeypatch.setattr(sampler_module, "CANDIDATES", candidates)
        tokens = torch.tensor(Sampler(seed=19)(x, params).token_ids)
        freqs.append(torch.bincount(tokens, minlength=BIG).double() / len(params))
    for token, p in want.items():
        assert freqs[0][token].item() == pytest.approx(p, abs=0.015)
        assert freqs[1][token].item() == pytest.approx(p, abs=0.015)
    for f in freqs:  # no token outside the nucleus
        assert set(torch.nonzero(f).flatten().tolist()) <= set(want)


def test_a_seeded_row_on_the_candidates_gives_the_same_tokens_beside_rows_that_sort() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=77)
    steps = [_peaky(300 + i) for i in range(8)]

    def flat(i: int, batch: int) -> torch.Tensor:  # the other rows: they take the sort
        return torch.randn(batch, BIG, generator=torch.Generator().manual_seed(i)) * 0.5

    run = partial(_seeded_row, params, SamplingParams(top_p=0.9), steps, flat)
    alone = run(1, 0)
    assert run(4, 2) == alone
    assert len(set(alone)) > 1


@pytest.mark.parametrize("inverse_cdf", [True, False])
def test_a_cpu_draw_follows_the_distribution_and_never_picks_a_zero(
    monkeypatch: pytest.MonkeyPatch, inverse_cdf: bool
) -> None:
    """The CPU's inverse-distribution draw and the exponential race give the same frequencies,
    and neither picks a token of probability 0 (between, before and after the others)."""
    monkeypatch.setattr(sampler_module, "INVERSE_CDF_ON_CPU", inverse_cdf)
    row = torch.full((BIG,), float("-inf"))
    live = torch.tensor([0, 1, 17, 2500, BIG - 2])
    row[live] = torch.tensor([1.0, 0.0, -1.0, 0.5, -0.5])
    n = 30000
    out = Sampler(seed=21)(row.expand(n, BIG).contiguous(), [SamplingParams(temperature=1)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=BIG).double() / n
    assert set(torch.nonzero(counts).flatten().tolist()) == set(live.tolist())
    want = torch.softmax(row[live].double(), dim=0)
    assert torch.allclose(counts[live], want, atol=0.012)


def test_logprobs_are_log_softmax_of_the_raw_logits_at_the_chosen_tokens() -> None:
    x = logits(4, seed=7)
    params = [
        SamplingParams(temperature=0, logprobs=True),
        SamplingParams(temperature=0.7, logprobs=1),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=5, logprobs=True),
    ]
    out = Sampler(seed=8)(x, params)
    reference = torch.log_softmax(x, dim=-1)
    for i in (0, 1, 3):
        assert out.logprobs[i] == pytest.approx(reference[i, out.token_ids[i]].item(), abs=1e-5)
    assert out.logprobs[2] is None


def test_a_mixed_batch_keeps_greedy_rows_greedy() -> None:
    x = logits(6, seed=9)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0) for i in range(6)]
    out = Sampler(seed=1)(x, params)
    assert [out.token_ids[i] for i in (1, 3, 5)] == x.argmax(dim=-1)[[1, 3, 5]].tolist()


def test_bad_shapes_are_rejected() -> None:
    sampler = Sampler()
    with pytest.raises(ValueError, match="float32"):
        sampler(logits(2).half(), [SamplingParams()] * 2)
    with pytest.raises(ValueError, match="SamplingParams"):
        sampler(logits(2), [SamplingParams()])
    with pytest.raises(ValueError, match="generators"):
        sampler(logits(2), [SamplingParams()] * 2, [None])


def test_sampling_params_defaults() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.n) == (1.0, 1.0, -1, 16, 1)
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert not p.greedy and not p.wants_logprobs
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(logprobs=2).wants_logprobs


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("stop", "END"),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", 1),
        ("logprobs", -1),
        ("logprobs", 1.5),
        ("n", 0),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
