"""Turn a step's logits into tokens: logit bias, min_tokens, repetition / frequency /
presence penalties, then greedy or temperature, min-p, top-k, top-p, per-request seeds.

Everything runs on the logits' device. Every transform is batched over the rows that need it:
one tensor op per transform per step, whatever the number of requests (the token histories that
penalties need become one padded tensor, the grammars' bitmasks one int32 tensor filled on the
host); what the host knows about the rows reaches the device without a stream sync
(`host_copy.to_device`). Rows that need no transform are read as they are.

Sampling draws with the exponential race: for probabilities p and independent E_i ~ Exp(1),
argmax_i p_i / E_i is distributed as p. The noise of a seeded request comes from its own
`torch.Generator` (on the logits' device), one full-vocabulary draw per step, so its tokens do
not depend on what else is in the batch or where its row is; requests without a seed share the
sampler's generator. On CPU two things differ, each giving every row the same distribution:
a draw inverts the row's distribution function with one uniform number from the same
generators (`Sampler._inverse_cdf`), and top-k / top-p avoid sorting the vocabulary wherever a
row's kept tokens are among its best CANDIDATES (`Sampler._truncated_on_cpu`: a trained
model's usual case; a flat distribution takes the sort). torch's CPU sort and `exponential_`
were most of a sampled step's sampling (8 rows of a 49,152-token vocabulary: 28 and 7.5 ms,
against 0.6 ms for `topk` and 0.4 ms for an fp64 running sum).
Log-probabilities (of the chosen token, and the best `top_logprobs` alternatives) are of the
model's own distribution (log_softmax of the raw logits, before any transform), as vLLM returns
them by default.

Only the results cross to the host, packed into one int32 tensor and copied once
(`host_copy.HostCopy`): per row its token id; per row that asked for log-probabilities the
chosen token's (fp32 bits); per alternative a row asked for, its id and log-probability. So
4 bytes per row, 4 per chosen log-probability and 8 per alternative, never a logits row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplane.dataplane.host_copy import HostCopy, to_device
from loraplane.dataplane.outputs import TopLogprobs
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.structured import Matcher, allocate_bitmask, apply_bitmask, fill_bitmasks

_LONG, _INT = torch.long, torch.int32
# top-k / top-p on CPU (`Sampler._truncated_on_cpu`): the best tokens a row's draw is first
# tried among, and the largest top_k taken as the candidates' number (0: always the full sort)
CANDIDATES, MAX_CANDIDATES = 128, 1024
# a draw on CPU inverts the row's distribution function (`Sampler._inverse_cdf`); False: the
# exponential race, as on a GPU
INVERSE_CDF_ON_CPU = True


class History(Protocol):
    """A row's tokens so far (the engine passes its Sequences)."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def token_ids(self) -> list[int]: ...  # the prompt, then the outputs


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device its logits will be on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """Per row: the chosen token, and its log-probability (and the best alternatives') if the
    row's request asked for them."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None] | None = None  # None: no row asked for alternatives


class Sampler:
    """Chooses one token per row of fp32 logits, following each row's SamplingParams, on the
    logits' device (`device`: where its shared generator draws, the logits' device)."""

    def __init__(
        self,
        seed: int = 0,
        device: torch.device | str = "cpu",
        host_copy: HostCopy | None = None,
    ):
        self.generator = make_generator(seed, device)
        self.host_copy = host_copy if host_copy is not None else HostCopy()

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V] fp32
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        histories: Sequence[History] | None = None,
        matchers: Sequence[Matcher | None] | None = None,
    ) -> SamplerOutput:
        """Sample row i with params[i], drawing from generators[i] when it is not None;
        histories[i] holds row i's tokens so far (needed for penalties and min_tokens), and
        matchers[i] its grammar's state when its output is constrained (structured output)."""
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"logits must be [B, V] float32, got {logits.dtype} {logits.shape}")
        batch, vocab = logits.shape
        if len(params) != batch:
            raise ValueError(f"expected {batch} SamplingParams, got {len(params)}")
        gens = list(generators) if generators is not None else [None] * batch
        if len(gens) != batch:
            raise ValueError(f"expected {batch} generators, got {len(gens)}")
        if batch == 0:
            return SamplerOutput([], [], None)
        device = logits.device
        raw = logits
        changed = [
            i
            for i, p in enumerate(params)
            if p.transforms_logits(_num_outputs(histories, i) if p.min_tokens else 0)
        ]
        constrained = [i for i, m in enumerate(matchers or ()) if m is not None]
        if changed or constrained:
            logits = logits.clone()
        if constrained:  # first: what the grammars forbid is never chosen, whatever follows
            assert matchers is not None
            # filled on the host (pinned on CUDA), copied to the device once
            bitmask = allocate_bitmask(len(constrained), vocab, pin=device.type == "cuda")
            fill_bitmasks(
                [(m, r) for r, i in enumerate(constrained) if (m := matchers[i])], bitmask
            )
            apply_bitmask(logits, bitmask, to_device(constrained, _LONG, device))
        if changed:
            if histories is None or len(histories) != batch:
                raise ValueError("penalties and min_tokens need one history per row")
            sub = [params[i] for i in changed]
            if len(changed) == batch:
                logits = transform_logits(logits, sub, list(histories))
            else:
                rows = to_device(changed, _LONG, device)
                logits[rows] = transform_logits(logits[rows], sub, [histories[i] for i in changed])

        greedy = [i for i, p in enumerate(params) if p.greedy]
        random = [i for i, p in enumerate(params) if not p.greedy]
        if not random:
            tokens = logits.argmax(dim=-1)  # [B]
        else:
            tokens = torch.empty(batch, dtype=_LONG, device=device)  # [B]
            if greedy:
                rows = to_device(greedy, _LONG, device)
                tokens[rows] = logits[rows].argmax(dim=-1)
            whole = len(random) == batch
            rows = to_device(random, _LONG, device)
            temps = to_device([params[i].temperature for i in random], torch.float32, device)
            scaled = (logits if whole else logits[rows]) / temps.unsqueeze(1)  # [R, V]
            min_ps = [params[i].min_p for i in random]
            if any(min_ps):
                scaled = min_p_filter(scaled, min_ps)
            top_ks = [params[i].top_k for i in random]
            top_ps = [params[i].top_p for i in random]
            drawing = [gens[i] for i in random]
            if not any(k != -1 for k in top_ks) and not any(p < 1.0 for p in top_ps):
                chosen = self._draw(torch.softmax(scaled, dim=-1), drawing)  # [R]
            elif device.type == "cpu" and CANDIDATES > 0:
                chosen = self._truncated_on_cpu(scaled, top_ks, top_ps, drawing)
            else:
                scaled = _top_k_top_p(scaled, top_ks, top_ps)
                chosen = self._draw(torch.softmax(scaled, dim=-1), drawing)
            if whole:
                tokens = chosen
            else:
                tokens[rows] = chosen
        return self._results(raw, tokens, params)

    def _results(
        self,
        raw: torch.Tensor,  # [B, V] fp32: the logits before any transform
        tokens: torch.Tensor,  # [B] long: the chosen tokens
        params: Sequence[SamplingParams],
    ) -> SamplerOutput:
        """Pack the tokens and the log-probabilities asked for into one int32 tensor, copy it to
        the host once, and unpack it there (layout: the module docstring)."""
        batch, vocab = raw.shape
        device = raw.device
        wanted = [i for i, p in enumerate(params) if p.wants_logprobs]
        pieces = [tokens.to(_INT)]  # [B]
        counts: list[int] = []  # alternatives per wanted row, as sent
        if wanted:
            whole = len(wanted) == batch
            rows = None if whole else to_device(wanted, _LONG, device)
            logp = torch.log_softmax(raw if rows is None else raw[rows], dim=-1)  # [W, V]
            mine = tokens if rows is None else tokens[rows]
            pieces.append(logp.gather(1, mine.unsqueeze(1)).view(_INT).flatten())  # [W]
            most = min(max(params[i].top_logprobs for i in wanted), vocab)
            counts = [min(params[i].top_logprobs, most) for i in wanted]
            if most:
                values, ids = logp.topk(most, dim=-1)  # [W, most] each, best first
                values, ids = values.flatten(), ids.flatten()
                if any(n != most for n in counts):  # only the alternatives each row asked for
                    take = [r * most + c for r, n in enumerate(counts) for c in range(n)]
                    index = to_device(take, _LONG, device)
                    values, ids = values.index_select(0, index), ids.index_select(0, index)
                pieces += [ids.to(_INT), values.view(_INT)]
        host = self.host_copy(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        token_ids: list[int] = host[:batch].tolist()
        chosen: list[float | None] = [None] * batch
        top: list[TopLogprobs | None] | None = None
        if wanted:
            w = len(wanted)
            picked = host[batch : batch + w].view(torch.float32).tolist()
            for i, value in zip(wanted, picked, strict=True):
                chosen[i] = value
            sent = sum(counts)
            if sent:
                top = [None] * batch
                at = batch + w
                ids_list: list[int] = host[at : at + sent].tolist()
                values_list: list[float] = host[at + sent :].view(torch.float32).tolist()
                offset = 0
                for i, n in zip(wanted, counts, strict=True):
                    end = offset + n
                    top[i] = list(zip(ids_list[offset:end], values_list[offset:end], strict=True))
                    offset = end
        return SamplerOutput(token_ids, chosen, top)

    def _draw(
        self, probs: torch.Tensor, gens: list[torch.Generator | None]
    ) -> torch.Tensor:  # [R] long: the column each row's draw picks
        """One draw per row of `probs` [R, W]: argmax_i p_i / E_i (module docstring); on CPU
        by the inverse of the row's distribution function (`_inverse_cdf`)."""
        if probs.device.type == "cpu" and INVERSE_CDF_ON_CPU:
            return self._inverse_cdf(probs, gens)
        noise = self._noise(gens, probs.shape[1], probs.device)  # [R, W]
        return (probs / noise).argmax(dim=-1)

    def _inverse_cdf(
        self, probs: torch.Tensor, gens: list[torch.Generator | None]
    ) -> torch.Tensor:  # [R] long
        """Per row the first column whose running sum (fp64) passes U times the row's total,
        U uniform on [0, 1) from the row's generator (seeded) or ours: the same distribution
        as the race, from one random number per row instead of one per column (on CPU the
        noise was most of a temperature draw's time). A column of probability 0 is never
        picked: the running sum does not pass anything at it."""
        rows, width = probs.shape
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [R, W], one allocation
        u = torch.empty(rows, 1, dtype=torch.float64)
        shared = [r for r, g in enumerate(gens) if g is None]
        if shared:
            u[torch.tensor(shared)] = torch.rand(len(shared), 1, dtype=torch.float64,
                                                 generator=self.generator)  # fmt: skip
        for r, g in enumerate(gens):
            if g is not None:
                u[r] = torch.rand(1, dtype=torch.float64, generator=g)
        picks = torch.searchsorted(cdf, u.mul_(cdf[:, -1:]), right=True)  # [R, 1]
        return picks.squeeze(1).clamp_max_(width - 1)

    def _truncated_on_cpu(
        self,
        scaled: torch.Tensor,  # [R, V]: logits over temperature
        top_ks: list[int],
        top_ps: list[float],
        gens: list[torch.Generator | None],
    ) -> torch.Tensor:  # [R] long: the chosen tokens
        """Top-k / top-p sampling without sorting the vocabulary where the row allows it: its
        best `width` tokens (one `topk`: CANDIDATES, or the largest top_k up to
        MAX_CANDIDATES) hold every token the full sort would keep when the row's top_k is
        within them, or when their mass reaches its top_p (every token past them then has at
        least that mass before it, and is dropped). Those rows draw among the candidates,
        with the same probabilities and the same keep rule as `_top_k_top_p` (each token's
        mass before it under top_p); the other rows (a flat distribution, a large top_k) take
        the full sort. On CPU only: it decides per row on the host, which on a GPU would be a
        sync (there the sort is one kernel, and the step's only copy is its results')."""
        rows, vocab = scaled.shape
        cap = [k for k in top_ks if 0 < k <= MAX_CANDIDATES]
        width = min(vocab, max(CANDIDATES, *cap) if cap else CANDIDATES)
        values, ids = scaled.topk(width, dim=-1)  # [R, W] each, best first
        ks = torch.tensor([vocab if k == -1 else min(k, vocab) for k in top_ks])
        within = torch.arange(width).unsqueeze(0) < ks.unsqueeze(1)  # [R, W]: inside top_k
        values = values.masked_fill(~within, float("-inf"))
        # each row's distribution: over its top_k (renormalised) when that is within the
        # candidates, else over the whole vocabulary
        norm = values.logsumexp(-1)
        wide = ks > width
        if bool(wide.any()):  # a pass over the whole vocabulary only for rows that need it
            norm = torch.where(wide, scaled.logsumexp(-1), norm)
        probs = (values - norm.unsqueeze(1)).exp_()  # [R, W], 0 past top_k
        mass = probs.cumsum(dim=-1)
        ps = torch.tensor([p if p < 1 else 2.0 for p in top_ps])  # top_p=1 keeps everything
        keep = within & (mass - probs < ps.unsqueeze(1))  # keeps at least the best token
        covered = ((ks <= width) | (mass[:, -1] >= ps)).tolist()
        chosen = torch.empty(rows, dtype=_LONG)
        inside = [r for r, c in enumerate(covered) if c]
        outside = [r for r, c in enumerate(covered) if not c]
        if inside:
            sub = torch.tensor(inside)
            picks = self._draw(probs[sub].mul_(keep[sub]), [gens[r] for r in inside])
            chosen[sub] = ids[sub].gather(1, picks.unsqueeze(1)).squeeze(1)
        if outside:
            sub = torch.tensor(outside)
            full = _top_k_top_p(scaled[sub], [top_ks[r] for r in outside],
                                [top_ps[r] for r in outside])  # fmt: skip
            chosen[sub] = self._draw(torch.softmax(full, dim=-1), [gens[r] for r in outside])
        return chosen

    def _noise(
        self, gens: list[torch.Generator | None], width: int, device: torch.device
    ) -> torch.Tensor:
        """Exp(1) noise [R, width]: seeded rows from their own generator, the rest from ours."""
        noise = torch.empty(len(gens), width, device=device)
        shared = [r for r, g in enumerate(gens) if g is None]
        if len(shared) == len(gens):
            noise.exponential_(generator=self.generator)
        elif shared:
            noise[to_device(shared, _LONG, device)] = torch.empty(
                len(shared), width, device=device
            ).exponential_(generator=self.generator)
        for r, g in enumerate(gens):
            if g is not None:
                noise[r].exponential_(generator=g)
        # an exact 0 would turn p/0 into inf (or nan for p=0): keep the race well defined
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _num_outputs(histories: Sequence[History] | None, i: int) -> int:
    if histories is None:
        return 0
    h = histories[i]
    return len(h.token_ids) - len(h.prompt_token_ids)


def transform_logits(
    logits: torch.Tensor,  # [R, V], a copy: changed in place
    params: list[SamplingParams],
    histories: list[History],
) -> torch.Tensor:
    """Apply logit_bias, min_tokens and the penalties to rows that need them, batched."""
    vocab = logits.shape[1]
    device = logits.device
    # logit_bias and the stop tokens min_tokens forbids: (row, token, value) triples, one op each
    bias_r, bias_t, bias_v, ban_r, ban_t = [], [], [], [], []
    for r, (p, h) in enumerate(zip(params, histories, strict=True)):
        for token, value in p.logit_bias.items():
            if token < vocab:
                bias_r.append(r)
                bias_t.append(token)
                bias_v.append(value)
        if len(h.token_ids) - len(h.prompt_token_ids) < p.min_tokens:
            ban = [t for t in p.stop_token_ids if t < vocab]
            ban_r += [r] * len(ban)
            ban_t += ban
    if bias_r:
        index = (to_device(bias_r, _LONG, device), to_device(bias_t, _LONG, device))
        logits.index_put_(index, to_device(bias_v, logits.dtype, device), accumulate=True)
    if ban_r:
        index = (to_device(ban_r, _LONG, device), to_device(ban_t, _LONG, device))
        logits.index_put_(index, torch.full((), float("-inf"), dtype=logits.dtype, device=device))
    penalised = [r for r, p in enumerate(params) if p.penalised]
    if len(penalised) == len(params):
        logits = _penalties(logits, params, histories)
    elif penalised:
        sub = to_device(penalised, _LONG, device)
        logits[sub] = _penalties(
            logits[sub], [params[r] for r in penalised], [histories[r] for r in penalised]
        )
    return logits


def _penalties(
    logits: torch.Tensor,  # [P, V]
    params: list[SamplingParams],
    histories: list[History],
) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties.

    Each row's tokens go into one padded [P, L] tensor (padding: id V, a column dropped after
    counting), so the counts of every row come from one scatter_add."""
    rows, vocab = logits.shape
    device = logits.device

    def counts(lists: list[list[int]]) -> torch.Tensor:  # [P, V] occurrences per token
        width = max(1, max(len(t) for t in lists))
        padded = torch.tensor([ids + [vocab] * (width - len(ids)) for ids in lists])
        padded = to_device(padded.clamp_(0, vocab), _LONG, device)
        out = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=device)
        return out.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))[:, :vocab]

    outputs = counts([h.token_ids[len(h.prompt_token_ids) :] for h in histories])
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = counts([h.prompt_token_ids for h in histories]).gt(0) | outputs.gt(0)
        rp = to_device([p.repetition_penalty for p in params], logits.dtype, device).unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    freq = to_device([p.frequency_penalty for p in params], logits.dtype, device).unsqueeze(1)
    pres = to_device([p.presence_penalty for p in params], logits.dtype, device).unsqueeze(1)
    return logits - freq * outputs - pres * outputs.gt(0).to(logits.dtype)


def min_p_filter(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Mask to -inf every token whose probability is under min_p times the best one's."""
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    floor = probs.amax(dim=-1, keepdim=True) * to_device(
        min_ps, probs.dtype, logits.device
    ).unsqueeze(1)
    return logits.masked_fill(probs < floor, float("-inf"))


def _top_k_top_p(
    logits: torch.Tensor,  # [R, V]
    top_ks: list[int],
    top_ps: list[float],
) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, then outside its top-p nucleus."""
    rows, vocab = logits.shape
    device = logits.device
    ordered, order = logits.sort(dim=-1, descending=True)  # [R, V] each
    ks = to_device([vocab if k == -1 else min(k, vocab) for k in top_ks], _LONG, device)
    ranks = torch.arange(vocab, device=device).expand(rows, vocab)  # [R, V]
    drop = ranks >= ks.unsqueeze(1)  # [R, V] in sorted order
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)  # the top-k distribution, renormalised
    before = probs.cumsum(dim=-1) - probs  # mass of the better tokens; 0 for the best
    # top_p=1 keeps everything, even where rounding pushes the mass before a token to 1
    ps = to_device([p if p < 1 else 2.0 for p in top_ps], probs.dtype, device)
    drop |= before >= ps.unsqueeze(1)  # keeps at least the best token: top_p > 0
    mask = torch.zeros_like(drop).scatter_(1, order, drop)  # back to vocabulary order
    return logits.masked_fill(mask, float("-inf"))
