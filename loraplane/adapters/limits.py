"""Limits an adapter is validated against: the pool's and the tenant's, whichever is lower."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterLimits:
    """Caps on one adapter. `max_rank` None means no rank limit (the CLI's default)."""

    max_rank: int | None = None
    max_bytes: int = 4 << 30
    max_tensors: int = 8192
    max_archive_entries: int = 64
    max_archive_bytes: int = (4 << 30) + (1 << 20)

    def __post_init__(self) -> None:
        if self.max_rank is not None and self.max_rank <= 0:
            raise ValueError(f"max_rank must be positive, got {self.max_rank}")
        for name in ("max_bytes", "max_tensors", "max_archive_entries", "max_archive_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def tightened(
        self, *, max_rank: int | None = None, max_bytes: int | None = None
    ) -> AdapterLimits:
        """These limits, lowered by a tenant quota or a pool setting where that is stricter."""
        rank = self.max_rank
        if max_rank is not None:
            rank = max_rank if rank is None else min(rank, max_rank)
        return AdapterLimits(
            max_rank=rank,
            max_bytes=min(self.max_bytes, max_bytes) if max_bytes is not None else self.max_bytes,
            max_tensors=self.max_tensors,
            max_archive_entries=self.max_archive_entries,
            max_archive_bytes=self.max_archive_bytes,
        )
