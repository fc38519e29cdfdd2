"""Read a PEFT LoRA adapter into host torch tensors, through the shared validating reader.

Adapter files come from tenants: they are opened and checked by `loraplane.adapters` (the same
code the control plane and operator run), never by a trusting loader. The scales honour
lora_alpha, use_rslora, rank_pattern and alpha_pattern as validation computed them.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.canonical import canonical_digest, stored_digest_start
from loraplane.adapters.errors import IntegrityError
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.safetensors_io import DTYPES, SafetensorsFile, TensorInfo
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import ValidatedAdapter, validate_adapter


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


READ_CHUNK = 8 << 20


def _read_stored(
    adapter: ValidatedAdapter,
) -> tuple[dict[tuple[int, str], LoRAWeights], str] | None:
    """A stored version's weights in one sequential read, hashed as they arrive.

    When the weights file is canonical (every stored version's is), its bytes are read once
    into one buffer while a second thread hashes each chunk read, and the tensors are views
    of that buffer: no memory map, no second copy. None when the file is not canonical.
    """
    h = stored_digest_start(adapter)
    if h is None:
        return None
    weights = adapter.weights
    buf = np.empty(weights.size, dtype=np.uint8)
    view = buf.data  # a writable memoryview of the buffer
    if weights.size <= READ_CHUNK:  # one read: nothing to overlap, so no hashing thread
        with open(weights.path, "rb", buffering=0) as f:
            if f.readinto(view) != weights.size:
                raise OSError(f"{weights.path.name} shrank while it was read")
        h.update(view)
    else:
        _read_hashing(weights.path, weights.size, view, h)
    modules = {
        (m.layer, m.module): LoRAWeights(
            a=_tensor_view(buf, weights.tensors[m.a_name]),
            b=_tensor_view(buf, weights.tensors[m.b_name]),
            scale=m.scale,
        )
        for m in adapter.modules
    }
    return modules, h.hexdigest()


def _read_hashing(path: Path, size: int, view: memoryview, h: Any) -> None:
    """Read `size` bytes of `path` into `view` in chunks while another thread hashes them."""
    chunks: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()

    def digest() -> None:
        while (chunk := chunks.get()) is not None:
            h.update(chunk)

    hasher = threading.Thread(target=digest, name="lora-digest")
    hasher.start()
    try:
        with open(path, "rb", buffering=0) as f:
            pos = 0
            while pos < size:
                n = f.readinto(view[pos : pos + READ_CHUNK])
                if not n:
                    raise OSError(f"{path.name} shrank while it was read")
                chunks.put(view[pos : pos + n])
                pos += n
    finally:
        chunks.put(None)
        hasher.join()


def _tensor_view(buf: np.ndarray[Any, Any], info: TensorInfo) -> torch.Tensor:
    """The tensor `info` as a view of `buf` (a copy where its offset is not aligned)."""
    dt = np.dtype(DTYPES[info.dtype][0])
    raw = buf[info.start : info.end]
    array = raw.view(dt) if info.start % dt.itemsize == 0 else raw.copy().view(dt)
    array = array.reshape(info.shape)
    if info.dtype == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def load_lora(
    path: Path | str,
    base: BaseModelSpec,
    limits: AdapterLimits | None = None,
    expected_digest: str | None = None,
) -> LoadedAdapter:
    """Validate the adapter at `path` (folder or archive) against `base`; copy its weights.

    Raises `AdapterRejected` with the reason code when any check fails. With
    `expected_digest` (a stored version: validated in full when it was ingested) the NaN/Inf
    scan is skipped and the digest must match, else IntegrityError: a canonical weights file
    (every stored one) is read in one pass into one buffer, hashed as it arrives, and the
    tensors are views of that buffer; another file is copied out of its memory map while a
    second thread hashes it. The weights file is closed before returning.
    """
    limits = limits or AdapterLimits()
    with open_adapter_source(path, limits) as files:
        adapter = validate_adapter(files, base, limits, scan_weights=expected_digest is None)
        if expected_digest is not None:
            try:
                stored = _read_stored(adapter)
            except BaseException:
                adapter.close()
                raise
            if stored is not None:
                adapter.close()
                modules, digest_hex = stored
                if digest_hex != expected_digest:
                    raise IntegrityError(str(path), expected_digest, digest_hex)
                return LoadedAdapter(source=str(path), modules=modules, digest=digest_hex)
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
