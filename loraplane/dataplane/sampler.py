"""Turn a step's logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Sampling draws with the exponential race: for probabilities p and independent E_i ~ Exp(1),
argmax_i p_i / E_i is distributed as p. The noise of a seeded request comes from its own
`torch.Generator`, one full-vocabulary draw per step, so its tokens do not depend on what else
is in the batch or where its row is; requests without a seed share the sampler's generator.
Log-probabilities are of the model's own distribution (log_softmax of the raw logits), as vLLM
returns them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplane.dataplane.sampling import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device its logits will be on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """Per row: the chosen token, and its log-probability if the row's request asked for it."""

    token_ids: list[int]
    logprobs: list[float | None]


class Sampler:
    """Chooses one token per row of fp32 logits, following each row's SamplingParams."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.generator = make_generator(seed, device)

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V] fp32
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> SamplerOutput:
        """Sample row i with params[i], drawing from generators[i] when it is not None."""
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"logits must be [B, V] float32, got {logits.dtype} {logits.shape}")
        batch, vocab = logits.shape
        if len(params) != batch:
            raise ValueError(f"expected {batch} SamplingParams, got {len(params)}")
        gens = list(generators) if generators is not None else [None] * batch
        if len(gens) != batch:
            raise ValueError(f"expected {batch} generators, got {len(gens)}")
        device = logits.device
        tokens = torch.empty(batch, dtype=torch.long, device=device)  # [B]

        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=device)
            tokens[rows] = logits[rows].argmax(dim=-1)
        random = [i for i, p in enumerate(params) if not p.greedy]
        if random:
            rows = torch.tensor(random, device=device)
            temps = torch.tensor([params[i].temperature for i in random], device=device)
            scaled = logits[rows] / temps.unsqueeze(1)  # [R, V]
            top_ks = [params[i].top_k for i in random]
            top_ps = [params[i].top_p for i in random]
            if any(k != -1 for k in top_ks) or any(p < 1.0 for p in top_ps):
                scaled = _top_k_top_p(scaled, top_ks, top_ps)
            probs = torch.softmax(scaled, dim=-1)  # [R, V]
            noise = self._noise([gens[i] for i in random], vocab, device)  # [R, V]
            tokens[rows] = (probs / noise).argmax(dim=-1)

        token_ids: list[int] = tokens.tolist()
        chosen: list[float | None] = [None] * batch
        wanted = [i for i, p in enumerate(params) if p.wants_logprobs]
        if wanted:
            rows = torch.tensor(wanted, device=device)
            logp = torch.log_softmax(logits[rows], dim=-1)  # [W, V]
            picked = logp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1)  # [W]
            for i, value in zip(wanted, picked.tolist(), strict=True):
                chosen[i] = value
        return SamplerOutput(token_ids, chosen)

    def _noise(
        self, gens: list[torch.Generator | None], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """Exp(1) noise [R, V]: seeded rows from their own generator, the rest from ours."""
        noise = torch.empty(len(gens), vocab, device=device)
        shared = [r for r, g in enumerate(gens) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), vocab, device=device).exponential_(
                generator=self.generator
            )
        for r, g in enumerate(gens):
            if g is not None:
                noise[r].exponential_(generator=g)
        # an exact 0 would turn p/0 into inf (or nan for p=0): keep the race well defined
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _top_k_top_p(
    logits: torch.Tensor,  # [R, V]
    top_ks: list[int],
    top_ps: list[float],
) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, then outside its top-p nucleus."""
    rows, vocab = logits.shape
    device = logits.device
    ordered, order = logits.sort(dim=-1, descending=True)  # [R, V] each
    ks = torch.tensor([vocab if k == -1 else min(k, vocab) for k in top_ks], device=device)
    ranks = torch.arange(vocab, device=device).expand(rows, vocab)  # [R, V]
    drop = ranks >= ks.unsqueeze(1)  # [R, V] in sorted order
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)  # the top-k distribution, renormalised
    before = probs.cumsum(dim=-1) - probs  # mass of the better tokens; 0 for the best
    # top_p=1 keeps everything, even where rounding pushes the mass before a token to 1
    ps = torch.tensor([p if p < 1 else 2.0 for p in top_ps], device=device, dtype=probs.dtype)
    drop |= before >= ps.unsqueeze(1)  # keeps at least the best token: top_p > 0
    mask = torch.zeros_like(drop).scatter_(1, order, drop)  # back to vocabulary order
    return logits.masked_fill(mask, float("-inf"))
