"""The canonical form of an adapter, and its digest.

Canonical weights: PEFT's tensor names, sorted, packed back to back behind a compact sorted JSON
header (metadata only `{"format": "pt"}`). Canonical config: the semantic fields, sorted. The
digest is sha256 over a domain tag, the config's length and bytes, then the weights file's bytes,
so re-serialising the same weights (another tensor order, other metadata, other extra config
fields) gives the same digest, and anyone can recompute it from the two stored files.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.safetensors_io import canonical_header
from loraplane.adapters.source import CONFIG_NAME, WEIGHTS_NAME, open_adapter_source
from loraplane.adapters.validate import ValidatedAdapter, check_finite, validate_adapter

DIGEST_DOMAIN = b"loraplane-adapter-v1\n"


@dataclass(frozen=True, slots=True)
class CanonicalAdapter:
    """The two canonical files written to a local folder, and their digest (hex sha256)."""

    digest: str
    config_path: Path
    weights_path: Path
    config_bytes: int
    weights_bytes: int


def start_digest(config: bytes) -> hashlib._Hash:
    """The digest with the domain tag and the canonical config fed in: feeding it the canonical
    weights file's bytes, in order, gives the version's digest."""
    h = hashlib.sha256(DIGEST_DOMAIN)
    h.update(len(config).to_bytes(8, "little"))
    h.update(config)
    return h


def canonical_digest(adapter: ValidatedAdapter) -> str:
    """The digest of the adapter's canonical form, without writing it anywhere."""
    config, header, sources = _layout(adapter)
    h = start_digest(config)
    h.update(header)
    for name in sources:
        h.update(adapter.weights.raw(name))
    return h.hexdigest()


def stored_digest_start(adapter: ValidatedAdapter) -> hashlib._Hash | None:
    """For an adapter whose weights file already is canonical (a stored version): the digest
    with the config fed in, so that feeding it the weights file's bytes in order gives the
    canonical digest. None when the file is not canonical (use `canonical_digest`)."""
    config, header, sources = _layout(adapter)
    weights = adapter.weights
    pos = len(header)
    for name in sources:
        info = weights.tensors[name]
        if info.start != pos:
            return None
        pos = info.end
    if pos != weights.size or weights.head(len(header)) != header:
        return None
    return start_digest(config)


def write_canonical(
    adapter: ValidatedAdapter, out_dir: Path, *, scan_weights: bool = False
) -> CanonicalAdapter:
    """Write the canonical files into `out_dir`, durably, and digest them.

    A second thread hashes from the memory map while this one copies the tensors (in the
    kernel where it can), fsyncs the copy and, with `scan_weights`, checks every tensor for
    NaN/Inf (failing with NonFiniteWeights; the caller then discards `out_dir`). Hashing is
    the slowest of these, so the digest costs little beyond a durable copy.
    """
    config, header, sources = _layout(adapter)
    weights = adapter.weights
    h = start_digest(config)
    failure: list[BaseException] = []

    def digest() -> None:
        try:
            h.update(header)
            for name in sources:
                h.update(weights.raw(name))
        except BaseException as e:  # re-raised in the caller's thread
            failure.append(e)

    out_dir.mkdir(parents=True, exist_ok=True)
    config_path, weights_path = out_dir / CONFIG_NAME, out_dir / WEIGHTS_NAME
    config_path.write_bytes(config)
    hasher = threading.Thread(target=digest, name="canonical-digest")
    hasher.start()
    try:
        size = _copy_tensors(adapter, header, sources, weights_path)
        if scan_weights:
            for name in sources:
                check_finite(weights, name)
    finally:
        hasher.join()
    if failure:
        raise failure[0]
    return CanonicalAdapter(h.hexdigest(), config_path, weights_path, len(config), size)


def _copy_tensors(adapter: ValidatedAdapter, header: bytes, sources: list[str], dest: Path) -> int:
    """Write header + tensors to `dest`; in-kernel copies (copy_file_range) where possible."""
    weights = adapter.weights
    with open(weights.path, "rb") as src, open(dest, "wb") as out:
        pos = out.write(header)
        out.flush()
        in_kernel = hasattr(os, "copy_file_range")
        for name in sources:
            info = weights.tensors[name]
            if in_kernel:
                try:
                    _copy_range(src.fileno(), out.fileno(), info.start, pos, info.nbytes)
                    pos += info.nbytes
                    continue
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    in_kernel = False  # this filesystem pair cannot: plain writes from here
            out.seek(pos)
            pos += out.write(weights.raw(name))
            out.flush()
        os.fsync(out.fileno())  # now, while the digest thread is still busy
    return pos


def _copy_range(src: int, dst: int, src_pos: int, dst_pos: int, count: int) -> None:
    while count > 0:
        n = os.copy_file_range(src, dst, count, src_pos, dst_pos)
        if n == 0:
            raise OSError(errno.EIO, "source file shrank while copying")
        src_pos, dst_pos, count = src_pos + n, dst_pos + n, count - n


def _layout(adapter: ValidatedAdapter) -> tuple[bytes, bytes, list[str]]:
    """Canonical config bytes, canonical weights header, source tensor names in file order."""
    config = adapter.spec.canonical_json()
    names: dict[str, str] = {}  # canonical name -> source tensor name
    for m in adapter.modules:
        a, b = m.canonical_names()
        names[a], names[b] = m.a_name, m.b_name
        if m.m_name:  # DoRA
            names[m.canonical_magnitude_name()] = m.m_name
    order = sorted(names)
    tensors = adapter.weights.tensors
    entries = [
        (n, tensors[names[n]].dtype, tensors[names[n]].shape, tensors[names[n]].nbytes)
        for n in order
    ]
    return config, canonical_header(entries), [names[n] for n in order]


def digest_files(config_path: Path, weights_path: Path) -> str:
    """Recompute the digest of stored canonical files (to verify a download or a cache)."""
    h = start_digest(config_path.read_bytes())
    with open(weights_path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def digest_of_source(source: Path, limits: AdapterLimits | None = None) -> str:
    """The canonical digest of the adapter at `source` (a folder, its weights file, or an
    archive), checked as far as it can be without a base model: what a tenant signs before
    pushing (`loraplane adapters sign`). The control plane computes the same digest for the
    same files (its refusal names the digest it computed, should they differ)."""
    limits = limits or AdapterLimits()
    path = source.parent if source.name in (WEIGHTS_NAME, CONFIG_NAME) else source
    with open_adapter_source(path, limits) as files:
        adapter = validate_adapter(files, None, limits, scan_weights=False)
        try:
            return canonical_digest(adapter)
        finally:
            adapter.close()
