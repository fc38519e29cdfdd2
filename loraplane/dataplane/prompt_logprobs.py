"""Prompt log-probabilities (vLLM's `prompt_logprobs`, completions' `echo` with `logprobs`),
reduced on the logits' device to what the request asked for.

A scoring request wants, per prompt token after the first, that token's log-probability, its
rank and the `top` best alternatives: 2 + 2 * top numbers out of a full-vocabulary row. So the
rows' logits never leave the device: the LM head runs over at most `ROW_SLICE` prompt positions
at a time, each slice is reduced at once (log_softmax in fp32, the token's value, its rank, the
top-k), and only the reductions of the whole step travel to the host, in one copy. A 4k-token
prompt over a 128k vocabulary thus takes O(ROW_SLICE x vocab) extra device memory, not the
2 GB its full logits would, and no host time per vocabulary entry.

The reductions of a slice are packed into one int32 tensor [rows, 2 + 2 * top]: the token's
log-probability (fp32 bits), its rank, the top ids, the top log-probabilities (fp32 bits).
Reinterpreting fp32 bits as int32 is exact, so one copy carries floats and ids alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplane.dataplane.host_copy import to_device, to_host
from loraplane.dataplane.sequence import PromptLogprob

# Prompt positions whose full-vocabulary fp32 logits exist at once (read at each call, so a
# test can make it small): 256 x 128k x 4 bytes = 128 MiB per intermediate tensor.
ROW_SLICE = 256


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Prompt positions of one request in a step: rows `start`..`start + len(tokens)` of the
    step's hidden states, whose logits predict `tokens` (prompt tokens `first`.. of it)."""

    request_id: str
    first: int  # index in the prompt of the first token scored (token 0 has no score)
    start: int  # row of the step's hidden states that predicts tokens[0]
    tokens: list[int]  # the prompt tokens the rows predict, one per row
    top: int  # alternatives per token: the request's prompt_logprobs


@dataclass(frozen=True, slots=True)
class PromptScores:
    """One request's scores of the prompt tokens of one step, on the host."""

    first: int  # index in the prompt of the first token scored
    tokens: list[int]
    top: int
    packed: torch.Tensor  # [len(tokens), 2 + 2 * top] int32, as the module docstring says

    def __len__(self) -> int:
        return len(self.tokens)

    def entries(self, skip: int = 0) -> list[PromptLogprob]:
        """The scores of tokens[skip:] (a recomputed prompt's tokens scored before skipped)."""
        rows, k = self.packed[skip:], self.top
        logprobs = rows[:, 0].view(torch.float32).tolist()
        ranks = rows[:, 1].tolist()
        ids = rows[:, 2 : 2 + k].tolist()
        values = rows[:, 2 + k :].view(torch.float32).tolist()
        return [
            PromptLogprob(token, lp, rank, list(zip(i, v, strict=True)))
            for token, lp, rank, i, v in zip(
                self.tokens[skip:], logprobs, ranks, ids, values, strict=True
            )
        ]


def reduce_logits(
    logits: torch.Tensor,  # [n, V] fp32, raw
    tokens: torch.Tensor,  # [n] int64: the token each row predicts
    top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, on the logits' device: the token's log-probability [n], its rank [n] (1 + the
    number of tokens whose log-probability is strictly greater: tied tokens share a rank) and
    the `top` best (log-probabilities [n, top], ids [n, top], best first).

        logp = log_softmax(logits); chosen = logp[tokens]
        rank = 1 + sum(logp > chosen); values, ids = topk(logp, top)
    """
    logp = torch.log_softmax(logits, dim=-1)  # [n, V]
    chosen = logp.gather(1, tokens.unsqueeze(1))  # [n, 1]
    # int32 counts: the same numbers, and on CPU about twice as fast as summing into int64
    ranks = (logp > chosen).sum(dim=-1, dtype=torch.int32) + 1  # [n]
    if top:
        values, ids = logp.topk(min(top, logp.shape[1]), dim=-1)  # [n, top] each
    else:
        values = logp.new_empty(logp.shape[0], 0)
        ids = torch.empty(logp.shape[0], 0, dtype=torch.long, device=logp.device)
    return chosen.squeeze(1), ranks, values, ids


def _pack(
    chosen: torch.Tensor,  # [n] fp32
    ranks: torch.Tensor,  # [n] int32
    values: torch.Tensor,  # [n, top] fp32
    ids: torch.Tensor,  # [n, top] int64
) -> torch.Tensor:  # [n, 2 + 2 * top] int32
    as_int = torch.int32
    return torch.cat(
        [
            chosen.unsqueeze(1).view(as_int),
            ranks.unsqueeze(1).to(as_int),
            ids.to(as_int),
            values.contiguous().view(as_int),
        ],
        dim=1,
    )


def score_prompts(
    spans: list[PromptSpan],
    hidden: torch.Tensor,  # [T, hidden]: the step's final hidden states
    compute_logits: Callable[[torch.Tensor], torch.Tensor],  # [N, hidden] -> [N, V] fp32
    copy: Callable[[torch.Tensor], torch.Tensor] = to_host,  # device -> host (a HostCopy)
) -> dict[str, PromptScores]:
    """Score every span's prompt tokens: the LM head and the reduction run over at most
    `ROW_SLICE` rows at a time, on the hidden states' device; the step's reductions come to
    the host in one `copy` (host_copy.py: pinned, non-blocking, then an event, on CUDA)."""
    if not spans:
        return {}
    device = hidden.device
    limit = ROW_SLICE
    # spans of one `top` share slices: a slice's packed rows all have one width
    by_top: dict[int, list[PromptSpan]] = {}
    for span in spans:
        by_top.setdefault(span.top, []).append(span)
    pieces: list[torch.Tensor] = []  # flat int32 reductions, in by_top order
    widths: dict[int, int] = {}  # top -> packed columns (top is capped at the vocabulary)
    for top, group in by_top.items():
        rows = torch.cat([torch.arange(s.start, s.start + len(s.tokens)) for s in group])
        tokens = torch.tensor([t for s in group for t in s.tokens], dtype=torch.long)
        rows, tokens = to_device(rows, torch.long, device), to_device(tokens, torch.long, device)
        for a in range(0, rows.shape[0], limit):
            logits = compute_logits(hidden.index_select(0, rows[a : a + limit]))  # [<=limit, V]
            packed = _pack(*reduce_logits(logits.float(), tokens[a : a + limit], top))
            del logits  # free the slice's logits before the next slice makes its own
            widths[top] = packed.shape[1]
            pieces.append(packed.flatten())
    flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    host = copy(flat)
    scores: dict[str, PromptScores] = {}
    offset = 0
    for top, group in by_top.items():
        width = widths[top]
        for s in group:
            n = len(s.tokens)
            packed = host[offset : offset + n * width].view(n, width)
            scores[s.request_id] = PromptScores(s.first, s.tokens, (width - 2) // 2, packed)
            offset += n * width
    return scores
