"""Limits an adapter is validated against: the pool's and the tenant's, whichever is lower."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterLimits:
    """Caps on one adapter. `max_rank` None means no rank limit (the CLI's default).

    `rank_limit` says whose limit `max_rank` is, for the refusal ("rank 64 exceeds <it>"):
    the pool's max_lora_rank or the tenant's quota; empty: "max_lora_rank N". `bytes_limit`
    likewise names `max_bytes` ("... bytes, over <it>"); empty: "the limit of N".
    """

    max_rank: int | None = None
    max_bytes: int = 4 << 30
    # A 4.x adapter names every expert's layers: Qwen3-235B-A22B's, all modules, holds
    # 94 x (4 + 128 x 3) x 2 = 72,944 tensors (Qwen3-30B-A3B's 37,248 validate in ~2 s).
    max_tensors: int = 1 << 17
    max_archive_entries: int = 64
    max_archive_bytes: int = (4 << 30) + (1 << 20)
    rank_limit: str = ""
    bytes_limit: str = ""

    def __post_init__(self) -> None:
        if self.max_rank is not None and self.max_rank <= 0:
            raise ValueError(f"max_rank must be positive, got {self.max_rank}")
        for name in ("max_bytes", "max_tensors", "max_archive_entries", "max_archive_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def tightened(
        self,
        *,
        max_rank: int | None = None,
        max_bytes: int | None = None,
        rank_limit: str = "",
        bytes_limit: str = "",
    ) -> AdapterLimits:
        """These limits, lowered by a tenant quota or a pool setting where that is stricter.
        `rank_limit` (`bytes_limit`) names `max_rank` (`max_bytes`) when it is the stricter
        one (at a tie, the limit already there keeps its name)."""
        rank, rank_named = self.max_rank, self.rank_limit
        if max_rank is not None and (rank is None or max_rank < rank):
            rank, rank_named = max_rank, rank_limit
        size, size_named = self.max_bytes, self.bytes_limit
        if max_bytes is not None and max_bytes < size:
            size, size_named = max_bytes, bytes_limit
        return AdapterLimits(
            max_rank=rank,
            max_bytes=size,
            max_tensors=self.max_tensors,
            max_archive_entries=self.max_archive_entries,
            max_archive_bytes=self.max_archive_bytes,
            rank_limit=rank_named,
            bytes_limit=size_named,
        )

    def rank_limit_text(self) -> str:
        """What a too-high rank exceeds, in words."""
        return self.rank_limit or f"max_lora_rank {self.max_rank}"

    def bytes_limit_text(self) -> str:
        """What too many weight bytes are over, in words."""
        return self.bytes_limit or f"the limit of {self.max_bytes}"
