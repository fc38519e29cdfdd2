"""Read a PEFT LoRA adapter into host torch tensors, through the shared validating reader.

Adapter files come from tenants: they are opened and checked by `loraplane.adapters` (the same
code the control plane and operator run), never by a trusting loader. The scales honour
lora_alpha, use_rslora, rank_pattern and alpha_pattern as validation computed them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.canonical import canonical_digest
from loraplane.adapters.errors import IntegrityError
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.safetensors_io import SafetensorsFile
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import validate_adapter


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One adapted linear layer: y += scale * B (A x)."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scale: float

    @property
    def rank(self) -> int:
        """r: rows of A, columns of B."""
        return int(self.a.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of A and B in their current dtype."""
        return self.a.nbytes + self.b.nbytes


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """A validated adapter held in host memory, keyed by (layer index, module name)."""

    source: str
    modules: dict[tuple[int, str], LoRAWeights]
    digest: str = ""  # the canonical digest (loraplane.adapters.canonical): the version's identity

    @property
    def rank(self) -> int:
        """The largest rank over the adapted modules."""
        return max((w.rank for w in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of all A and B tensors, in their stored dtype."""
        return sum(w.nbytes for w in self.modules.values())


def _to_torch(weights: SafetensorsFile, name: str) -> torch.Tensor:
    """Copy one tensor out of the memory map (BF16 arrives as uint16 bit patterns)."""
    view: np.ndarray[Any, Any] = weights.array(name)
    copy = np.array(view, copy=True)
    if weights.tensors[name].dtype == "BF16":
        return torch.from_numpy(copy.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(copy)


def load_lora(
    path: Path | str,
    base: BaseModelSpec,
    limits: AdapterLimits | None = None,
    expected_digest: str | None = None,
) -> LoadedAdapter:
    """Validate the adapter at `path` (folder or archive) against `base`; copy its weights.

    Raises `AdapterRejected` with the reason code when any check fails. With
    `expected_digest` (a stored version: validated in full when it was ingested) the NaN/Inf
    scan is skipped and the digest, computed on a second thread while the weights are copied,
    must match, else IntegrityError. The weights file is closed before returning.
    """
    limits = limits or AdapterLimits()
    with open_adapter_source(path, limits) as files:
        adapter = validate_adapter(files, base, limits, scan_weights=expected_digest is None)
        adapter.weights.will_need()
        digest: list[str] = []
        hasher = threading.Thread(target=lambda: digest.append(canonical_digest(adapter)))
        hasher.start()
        try:
            modules = {
                (m.layer, m.module): LoRAWeights(
                    a=_to_torch(adapter.weights, m.a_name),
                    b=_to_torch(adapter.weights, m.b_name),
                    scale=m.scale,
                )
                for m in adapter.modules
            }
        finally:
            hasher.join()
            adapter.close()
    if not digest:  # pragma: no cover - canonical_digest only fails on I/O errors
        raise IntegrityError(str(path), expected_digest or "", "")
    if expected_digest is not None and digest[0] != expected_digest:
        raise IntegrityError(str(path), expected_digest, digest[0])
    return LoadedAdapter(source=str(path), modules=modules, digest=digest[0])
