"""A stored version's weights in one sequential read, hashed as they arrive, and the memo of
validated layouts that lets a later version of the same recipe skip validation (`load_lora`
in loader.py calls these; see its docstring for when each applies).

The tensors are views of the one read buffer (`_weights`), so `LoRAPool.host_form` converts
them in one operation.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from io import FileIO
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.canonical import start_digest, stored_digest_start
from loraplane.adapters.errors import IntegrityError
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.safetensors_io import DTYPES, MAX_HEADER_BYTES, TensorInfo
from loraplane.adapters.source import AdapterFiles
from loraplane.adapters.validate import ModuleLoRA, ValidatedAdapter
from loraplane.dataplane.lora.weights import LoadedAdapter, LoRAWeights

READ_CHUNK = 8 << 20
# validated layouts remembered (see `Layout`): adapters trained by one recipe share one
MAX_LAYOUTS = 64

_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


@dataclass(frozen=True, slots=True)
class Layout:
    """What validating a stored version found, true of any file with the same config bytes,
    weights header bytes and size (validation reads nothing else, for a given base model and
    limits): the canonical config its digest starts with, and each module's tensors."""

    config: bytes
    # each module's A and B, and its DoRA magnitude vector (None: plain LoRA)
    modules: tuple[tuple[ModuleLoRA, TensorInfo, TensorInfo, TensorInfo | None], ...]


# (sha256 of the config and weights header bytes, weights file size, base model, limits)
LayoutKey = tuple[bytes, int, BaseModelSpec, AdapterLimits]
_layouts: OrderedDict[LayoutKey, Layout] = OrderedDict()
_layouts_lock = threading.Lock()


def layout_key(
    config: bytes, header: bytes, size: int, base: BaseModelSpec, limits: AdapterLimits
) -> LayoutKey:
    """The memo's key: the bytes hashed, not kept (a header may be megabytes long)."""
    h = hashlib.sha256(len(config).to_bytes(8, "little"))
    h.update(config)
    h.update(header)
    return h.digest(), size, base, limits


def _known_layout(key: LayoutKey) -> Layout | None:
    with _layouts_lock:
        layout = _layouts.get(key)
        if layout is not None:
            _layouts.move_to_end(key)
        return layout


def remember_layout(key: LayoutKey, layout: Layout) -> None:
    with _layouts_lock:
        _layouts[key] = layout
        _layouts.move_to_end(key)
        while len(_layouts) > MAX_LAYOUTS:
            _layouts.popitem(last=False)


def _read_header(f: FileIO, size: int) -> bytes | None:
    """The weights file's first bytes up to the end of its header (None: not a plausible one;
    the full validation then says what is wrong)."""
    head = f.read(8)
    if len(head) < 8:
        return None
    end = 8 + int.from_bytes(head, "little")
    if end > min(size, 8 + MAX_HEADER_BYTES):
        return None
    rest = f.read(end - 8)
    return head + rest if len(rest) == end - 8 else None


def _read_hashed(f: FileIO, size: int, h: Any) -> np.ndarray[Any, Any]:
    """The whole file `f` (from its start) in one buffer, fed to `h` as it arrives: in one
    read when small, else in chunks that a second thread hashes while the next is read."""
    f.seek(0)
    buf = np.empty(size, dtype=np.uint8)
    view = buf.data  # a writable memoryview of the buffer
    if size <= READ_CHUNK:  # one read: nothing to overlap, so no hashing thread
        if f.readinto(view) != size:
            raise OSError(f"{Path(f.name).name} shrank while it was read")
        h.update(view)
        return buf
    chunks: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()

    def digest() -> None:
        while (chunk := chunks.get()) is not None:
            h.update(chunk)

    hasher = threading.Thread(target=digest, name="lora-digest")
    hasher.start()
    try:
        pos = 0
        while pos < size:
            n = f.readinto(view[pos : pos + READ_CHUNK])
            if not n:
                raise OSError(f"{Path(f.name).name} shrank while it was read")
            chunks.put(view[pos : pos + n])
            pos += n
    finally:
        chunks.put(None)
        hasher.join()
    return buf


def _weights(buf: np.ndarray[Any, Any], layout: Layout) -> dict[tuple[int, str], LoRAWeights]:
    """Each module's A and B as views of `buf`, all of one torch storage (so `LoRAPool.
    host_form` converts them in one operation): one torch operation per tensor (loader threads
    hand the GIL over at each, so these are kept few)."""
    whole = torch.from_numpy(buf)
    typed: dict[str, torch.Tensor] = {}  # the buffer as each dtype its tensors have
    return {
        (m.layer, m.module): LoRAWeights(
            a=_tensor_view(whole, typed, a),
            b=_tensor_view(whole, typed, b),
            scale=m.scale,
            magnitude=_tensor_view(whole, typed, mag) if mag is not None else None,
        )
        for m, a, b, mag in layout.modules
    }


def _tensor_view(whole: torch.Tensor, typed: dict[str, torch.Tensor], info: TensorInfo
                 ) -> torch.Tensor:  # fmt: skip
    """The tensor `info` as a view of the file's bytes `whole` (a copy where its offset is not
    aligned to its element size); `typed` memoises `whole` viewed as each dtype."""
    size = DTYPES[info.dtype][1]
    if info.start % size:
        raw = whole[info.start : info.end].clone()
        return raw.view(_TORCH_DTYPES[info.dtype]).view(info.shape)
    as_dtype = typed.get(info.dtype)
    if as_dtype is None:
        usable = whole.numel() - whole.numel() % size
        as_dtype = typed[info.dtype] = whole[:usable].view(_TORCH_DTYPES[info.dtype])
    strides = [1] * len(info.shape)
    for d in range(len(info.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * info.shape[d + 1]
    return as_dtype.as_strided(info.shape, strides, info.start // size)


def load_known(
    files: AdapterFiles,
    base: BaseModelSpec,
    limits: AdapterLimits,
    expected_digest: str,
    source: str,
) -> LoadedAdapter | None:
    """A stored version whose config and weights header are byte for byte those of one
    validated before (against the same base and limits): read, hashed and checked against
    its digest without validating again. None when the layout is not known (or the file
    changed while it was read): the caller validates it in full."""
    try:
        config = files.config_path.read_bytes()
        with open(files.weights_path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            header = _read_header(f, size)
            if header is None:
                return None
            layout = _known_layout(layout_key(config, header, size, base, limits))
            if layout is None:
                return None
            h = start_digest(layout.config)
            buf = _read_hashed(f, size, h)
    except OSError:
        return None  # the full validation reports it
    if buf[: len(header)].tobytes() != header:
        return None
    digest = h.hexdigest()
    if digest != expected_digest:
        raise IntegrityError(source, expected_digest, digest)
    return LoadedAdapter(source, _weights(buf, layout), digest, owns_tensors=True)


def read_stored(
    adapter: ValidatedAdapter, source: str
) -> tuple[LoadedAdapter, Layout, bytes] | None:
    """A validated stored version's weights in one sequential read, hashed as they arrive
    (the digest is not checked here), with its layout and its weights header. None when
    the weights file is not canonical; OSError when it changed since it was validated."""
    h = stored_digest_start(adapter)
    if h is None:
        return None
    weights = adapter.weights
    header = weights.head(8 + int.from_bytes(weights.head(8), "little"))
    layout = Layout(
        adapter.spec.canonical_json(),
        tuple(
            (
                m,
                weights.tensors[m.a_name],
                weights.tensors[m.b_name],
                weights.tensors[m.m_name] if m.m_name else None,
            )
            for m in adapter.modules
        ),
    )
    with open(weights.path, "rb", buffering=0) as f:
        buf = _read_hashed(f, weights.size, h)
    if buf[: len(header)].tobytes() != header:
        raise OSError(f"{weights.path.name} changed while it was read")
    loaded = LoadedAdapter(source, _weights(buf, layout), h.hexdigest(), owns_tensors=True)
    return loaded, layout, header
