"""The canonical form of an adapter, and its digest.

Canonical weights: PEFT's tensor names, sorted, packed back to back behind a compact sorted JSON
header (metadata only `{"format": "pt"}`). Canonical config: the semantic fields, sorted. The
digest is sha256 over a domain tag, the config's length and bytes, then the weights file's bytes,
so re-serialising the same weights (another tensor order, other metadata, other extra config
fields) gives the same digest, and anyone can recompute it from the two stored files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from loraplane.adapters.safetensors_io import canonical_header, iter_chunks
from loraplane.adapters.source import CONFIG_NAME, WEIGHTS_NAME
from loraplane.adapters.validate import ValidatedAdapter

DIGEST_DOMAIN = b"loraplane-adapter-v1\n"


@dataclass(frozen=True, slots=True)
class CanonicalAdapter:
    """The two canonical files written to a local folder, and their digest (hex sha256)."""

    digest: str
    config_path: Path
    weights_path: Path
    config_bytes: int
    weights_bytes: int


def _start_digest(config: bytes) -> hashlib._Hash:
    h = hashlib.sha256(DIGEST_DOMAIN)
    h.update(len(config).to_bytes(8, "little"))
    h.update(config)
    return h


def canonical_digest(adapter: ValidatedAdapter) -> str:
    """The digest of the adapter's canonical form, without writing it anywhere."""
    return _emit(adapter, None).digest


def write_canonical(adapter: ValidatedAdapter, out_dir: Path) -> CanonicalAdapter:
    """Write the canonical files into `out_dir`, hashing as they are written (one pass)."""
    return _emit(adapter, out_dir)


def _emit(adapter: ValidatedAdapter, out_dir: Path | None) -> CanonicalAdapter:
    config = adapter.spec.canonical_json()
    # canonical name -> source tensor name, in canonical (sorted) order
    names: dict[str, str] = {}
    for m in adapter.modules:
        a, b = m.canonical_names()
        names[a], names[b] = m.a_name, m.b_name
    order = sorted(names)
    tensors = adapter.weights.tensors
    header = canonical_header(
        [
            (n, tensors[names[n]].dtype, tensors[names[n]].shape, tensors[names[n]].nbytes)
            for n in order
        ]
    )
    h = _start_digest(config)
    h.update(header)
    size = len(header)
    if out_dir is None:
        config_path = weights_path = Path()
        for n in order:
            h.update(adapter.weights.raw(names[n]))
            size += tensors[names[n]].nbytes
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        config_path, weights_path = out_dir / CONFIG_NAME, out_dir / WEIGHTS_NAME
        config_path.write_bytes(config)
        with open(weights_path, "wb") as f:
            f.write(header)
            for n in order:
                for piece in iter_chunks(adapter.weights.raw(names[n])):
                    f.write(piece)
                    h.update(piece)
                    size += len(piece)
    return CanonicalAdapter(h.hexdigest(), config_path, weights_path, len(config), size)


def digest_files(config_path: Path, weights_path: Path) -> str:
    """Recompute the digest of stored canonical files (to verify a download or a cache)."""
    h = _start_digest(config_path.read_bytes())
    with open(weights_path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()
