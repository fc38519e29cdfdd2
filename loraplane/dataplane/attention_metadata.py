"""A step's attention metadata (where each sequence's queries and K/V are) and the options check
both attention paths share: a leaf module, so the Triton kernel (kernels/attention_triton.py)
and the torch path (attention.py, which dispatches to the kernel) need not import each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplane.dataplane.kernels.backends import ATTENTION_BACKENDS, ATTENTION_ENV, read_choice

_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(slots=True)
class AttentionMetadata:
    """Where each sequence's queries sit in the flat batch and where its K/V live in the cache.

    `host_cu_seqlens_q` / `host_context_lens` are the same numbers as Python ints; pass them when
    the tensors are on a GPU so the torch path never waits on the device (they are read back
    once otherwise).
    """

    cu_seqlens_q: torch.Tensor  # [B + 1] int: query offsets into the flat batch, starts at 0
    context_lens: torch.Tensor  # [B] int: cached prefix + this step's new tokens, per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    host_cu_seqlens_q: list[int] = field(default_factory=list)
    host_context_lens: list[int] = field(default_factory=list)
    # what the CPU attention derives from these once per step and every layer reuses
    # (attention._decode_plan); only for CPU tensors, which nobody refills in place
    memo: dict[object, object] = field(default_factory=dict, compare=False, repr=False)
    # LORAPLANE_ATTENTION (auto, native, torch, triton): read here, once per step, unless given;
    # every layer's `attention.backend` resolves it against its queries
    backend: str = ""

    def __post_init__(self) -> None:
        if not self.backend:
            self.backend = read_choice(ATTENTION_ENV, ATTENTION_BACKENDS)
        for name in ("cu_seqlens_q", "context_lens", "block_tables", "slot_mapping"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype not in _INT_DTYPES:
                raise ValueError(f"{name} must be an int32 or int64 tensor")
        if self.cu_seqlens_q.dim() != 1 or self.cu_seqlens_q.numel() < 1:
            raise ValueError("cu_seqlens_q must be 1-D with B + 1 entries")
        batch = self.cu_seqlens_q.numel() - 1
        if self.context_lens.shape != (batch,):
            raise ValueError(
                f"context_lens has shape {tuple(self.context_lens.shape)}, expected ({batch},)"
            )
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != batch:
            raise ValueError(
                f"block_tables has shape {tuple(self.block_tables.shape)}, expected ({batch}, N)"
            )
        if not self.host_cu_seqlens_q:
            self.host_cu_seqlens_q = [int(v) for v in self.cu_seqlens_q.tolist()]
        if not self.host_context_lens:
            self.host_context_lens = [int(v) for v in self.context_lens.tolist()]
        cu, ctx = self.host_cu_seqlens_q, self.host_context_lens
        if len(cu) != batch + 1 or len(ctx) != batch:
            raise ValueError("host_cu_seqlens_q / host_context_lens do not match the tensors")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens_q must start at 0, got {cu[0]}")
        for i in range(batch):
            q_len = cu[i + 1] - cu[i]
            if q_len < 1:
                raise ValueError(f"cu_seqlens_q: sequence {i} has {q_len} query tokens")
            if ctx[i] < q_len:
                raise ValueError(
                    f"context_lens[{i}] = {ctx[i]} is smaller than its {q_len} query tokens"
                )
        if self.slot_mapping.shape != (cu[-1],):
            raise ValueError(
                f"slot_mapping has shape {tuple(self.slot_mapping.shape)}, expected ({cu[-1]},)"
            )

    @property
    def num_seqs(self) -> int:
        """B: sequences in the step."""
        return len(self.host_context_lens)

    @property
    def num_tokens(self) -> int:
        """T: query tokens in the flat batch."""
        return self.host_cu_seqlens_q[-1]

    @classmethod
    def build(
        cls,
        q_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences given as host lists (what a model runner holds).

        Sequence i's queries are context positions `context_lens[i] - q_lens[i]` to
        `context_lens[i] - 1`; its block table must cover `context_lens[i]` tokens.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not len(q_lens) == len(context_lens) == len(block_tables):
            raise ValueError("q_lens, context_lens and block_tables must have one entry per seq")
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.full((len(block_tables), max(width, 1)), -1, dtype=torch.int32)
        slots: list[torch.Tensor] = []
        for i, (q_len, ctx, table) in enumerate(
            zip(q_lens, context_lens, block_tables, strict=True)
        ):
            if len(table) * block_size < ctx:
                raise ValueError(
                    f"block_tables[{i}] has {len(table)} blocks of {block_size}: too few for "
                    f"context_lens[{i}] = {ctx}"
                )
            if any(b < 0 for b in table):
                raise ValueError(f"block_tables[{i}] holds a negative block id")
            row = torch.tensor(list(table), dtype=torch.int64)
            tables[i, : len(table)] = row.to(torch.int32)
            pos = torch.arange(ctx - q_len, ctx, dtype=torch.int64)
            slots.append(row[pos // block_size] * block_size + pos % block_size)
        cu = [0]
        for q_len in q_lens:
            cu.append(cu[-1] + q_len)
        slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        return cls(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            slot_mapping=slot_mapping.to(device),
            host_cu_seqlens_q=cu,
            host_context_lens=list(context_lens),
        )


def check_options(sliding_window: int | None, softcap: float | None) -> None:
    """ValueError unless the window is None or >= 1 and the soft-cap None or > 0."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
