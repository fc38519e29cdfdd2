"""A defensive safetensors reader for untrusted files, and the canonical writer.

The format: 8 bytes little-endian header length N, N bytes of UTF-8 JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the
data section, where offsets are relative. Every rule below is checked before any tensor byte is
touched; tensors are then read through one read-only memory map (never a second copy in memory).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import numpy as np

from loraplane.adapters.errors import AdapterRejected, ReasonCode

# name -> (numpy storage dtype, bytes per element). BF16 has no numpy dtype: it is read as
# uint16 bit patterns (the engine reinterprets them; validation checks the exponent bits).
DTYPES: dict[str, tuple[str, int]] = {"F16": ("<f2", 2), "BF16": ("<u2", 2), "F32": ("<f4", 4)}
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_NAME_LEN = 512
MAX_DIMS = 8
MAX_METADATA_ENTRIES = 1024
MAX_METADATA_VALUE_LEN = 65536

# Exponent masks: a float is NaN or Inf exactly when all its exponent bits are set.
_EXPONENT_MASK: dict[str, tuple[str, int]] = {
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F32": ("<u4", 0x7F800000),
}


def _bad(message: str) -> AdapterRejected:
    return AdapterRejected(ReasonCode.INVALID_SAFETENSORS, message)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's header entry, with offsets made absolute within the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _bad(f"header has duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_LEN:
        raise _bad(f"tensor name of length {len(name)} (allowed 1 to {MAX_NAME_LEN})")
    if _CONTROL.search(name):
        raise _bad(f"tensor name {name!r} contains control characters")


def _check_metadata(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _bad("__metadata__ must be an object of strings")
    if len(value) > MAX_METADATA_ENTRIES:
        raise _bad(f"__metadata__ has {len(value)} entries (limit {MAX_METADATA_ENTRIES})")
    for k, v in value.items():
        if not isinstance(v, str):
            raise _bad(f"__metadata__[{k!r}] is not a string")
        if len(k) > MAX_NAME_LEN or len(v) > MAX_METADATA_VALUE_LEN:
            raise _bad(f"__metadata__ entry {k[:40]!r} is too long")
    return value


def _parse_entry(name: str, entry: object, data_start: int) -> TensorInfo:
    _check_name(name)
    if not isinstance(entry, dict):
        raise _bad(f"entry for tensor {name!r} is not an object")
    if set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _bad(
            f"tensor {name!r} must have exactly dtype, shape and data_offsets (has {sorted(entry)})"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _bad(f"tensor {name!r} has dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise _bad(f"tensor {name!r} shape must be a list of at most {MAX_DIMS} integers")
    if not all(_is_int(d) and d >= 0 for d in shape):
        raise _bad(f"tensor {name!r} shape {shape!r} must hold non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise _bad(f"tensor {name!r} data_offsets must be two integers")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise _bad(f"tensor {name!r} has reversed or negative data_offsets [{begin}, {end}]")
    # Python integers do not overflow; a product of huge dims simply fails the size check.
    expected = math.prod(shape) * DTYPES[dtype][1]
    if expected != end - begin:
        raise _bad(
            f"tensor {name!r}: shape {shape} x {dtype} needs {expected} bytes, "
            f"data_offsets span {end - begin}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


class SafetensorsFile:
    """A validated, memory-mapped safetensors file.

    Opening checks the whole header; every failure raises `AdapterRejected` with code
    InvalidSafetensors (or TooLarge for `max_tensors`), never another exception.
    """

    def __init__(self, path: Path | str, *, max_tensors: int = 100_000) -> None:
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.tensors, self.metadata = self._read_header(f, size, max_tensors)
                if size > 0:
                    self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise _bad(f"cannot read {self.path.name}: {e.strerror or e}") from e
        self.size = size

    @staticmethod
    def _read_header(
        f: IO[bytes], size: int, max_tensors: int
    ) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        if size < 8:
            raise _bad(f"file is {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise _bad(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
        if n < 2 or 8 + n > size:
            raise _bad(f"header length {n} does not fit in a file of {size} bytes")
        raw = f.read(n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad(f"header is not valid UTF-8 (byte {e.start})") from e
        if not text.startswith("{"):
            raise _bad("header does not start with a JSON object")
        try:
            header = json.loads(
                text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
            )
        except AdapterRejected:
            raise
        except (ValueError, RecursionError) as e:
            raise _bad(f"header is not valid JSON: {str(e)[:200]}") from e
        if not isinstance(header, dict):
            raise _bad("header is not a JSON object")
        metadata = _check_metadata(header.pop("__metadata__", {}))
        if len(header) > max_tensors:
            raise AdapterRejected(
                ReasonCode.TOO_LARGE, f"{len(header)} tensors exceed the limit of {max_tensors}"
            )
        data_start = 8 + n
        tensors = {name: _parse_entry(name, e, data_start) for name, e in header.items()}
        _check_tiling(tensors, size - data_start, data_start)
        return tensors, metadata

    def head(self, n: int) -> bytes:
        """The file's first `n` bytes (at most its size)."""
        if self._mmap is None:
            return b""
        return bytes(self._mmap[:n])

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes, as a view into the memory map (no copy)."""
        info = self.tensors[name]
        if self._mmap is None:
            return memoryview(b"")
        return memoryview(self._mmap)[info.start : info.end]

    def array(self, name: str) -> np.ndarray[Any, Any]:
        """The tensor as a read-only numpy view (BF16 as uint16 bit patterns)."""
        info = self.tensors[name]
        dt = np.dtype(DTYPES[info.dtype][0])
        count = info.nbytes // dt.itemsize
        if self._mmap is None or count == 0:
            return np.zeros(info.shape, dtype=dt)
        return np.frombuffer(self._mmap, dtype=dt, count=count, offset=info.start).reshape(
            info.shape
        )

    def first_non_finite(self, name: str) -> int | None:
        """Flat index of the first NaN or Inf in the tensor, or None if all are finite."""
        info = self.tensors[name]
        if self._mmap is None or info.nbytes == 0:
            return None
        bits_dtype, mask = _EXPONENT_MASK[info.dtype]
        dt = np.dtype(bits_dtype)
        bits = np.frombuffer(
            self._mmap, dtype=dt, count=info.nbytes // dt.itemsize, offset=info.start
        )
        bad = np.flatnonzero((bits & mask) == mask)
        return int(bad[0]) if bad.size else None

    def will_need(self) -> None:
        """Ask the kernel to read the whole file ahead (one sequential read, not page faults)."""
        if self._mmap is not None and hasattr(mmap, "MADV_WILLNEED"):
            with contextlib.suppress(OSError):
                self._mmap.madvise(mmap.MADV_WILLNEED)

    def close(self) -> None:
        if self._mmap is not None:
            # With numpy views still alive the map cannot close now; it closes when they go.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _reject_constant(token: str) -> None:
    raise _bad(f"header contains the non-JSON constant {token}")


def _check_tiling(tensors: dict[str, TensorInfo], data_len: int, data_start: int) -> None:
    """Offsets must cover the data section exactly: no gap, overlap or byte out of range."""
    pos = 0
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        begin, end = info.start - data_start, info.end - data_start
        if begin < pos:
            raise _bad(f"tensor {info.name!r} at [{begin}, {end}] overlaps the previous tensor")
        if begin > pos:
            raise _bad(f"gap of {begin - pos} bytes before tensor {info.name!r} at offset {begin}")
        if end > data_len:
            raise _bad(
                f"tensor {info.name!r} ends at {end}, past the data section of {data_len} bytes"
            )
        pos = end
    if pos != data_len:
        raise _bad(f"{data_len - pos} trailing bytes after the last tensor")


def canonical_header(entries: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """The header of a canonical file: tensors in the given order, packed back to back.

    `entries` holds (name, dtype, shape, nbytes). The JSON is compact with sorted keys,
    padded with spaces to a multiple of 8 bytes, as the safetensors library aligns it.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body
