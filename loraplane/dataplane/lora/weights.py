"""The host form of an adapter's weights: one adapted linear layer's factors (`LoRAWeights`)
and a validated adapter's modules (`LoadedAdapter`), what the loader reads and the pool,
the tiers and the LoRA layers take."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One adapted linear layer: y += scale * B (A x); with a DoRA `magnitude` m, the layer's
    output is then rescaled per row by m / ||W + scale * B A|| (lora/dora.py)."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scale: float
    magnitude: torch.Tensor | None = None  # [out_features]: DoRA's, as stored; None: plain LoRA

    @property
    def rank(self) -> int:
        """r: rows of A, columns of B."""
        return int(self.a.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of A and B (and a DoRA magnitude vector) in their current dtype."""
        extra = self.magnitude.nbytes if self.magnitude is not None else 0
        return self.a.nbytes + self.b.nbytes + extra


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """A validated adapter held in host memory, keyed by (layer index, module name)."""

    source: str
    modules: dict[tuple[int, str], LoRAWeights]
    digest: str = ""  # the canonical digest (loraplane.adapters.canonical): the version's identity
    # True when its tensors were read for it alone (a stored version's one file buffer) and
    # nothing else references them: `host_form.convert` may then rewrite them in place
    owns_tensors: bool = False

    @property
    def rank(self) -> int:
        """The largest rank over the adapted modules."""
        return max((w.rank for w in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of all A and B tensors (and magnitude vectors), in their stored dtype."""
        return sum(w.nbytes for w in self.modules.values())

    @property
    def is_dora(self) -> bool:
        """True when a module carries a DoRA magnitude vector."""
        return any(w.magnitude is not None for w in self.modules.values())
