"""Read a PEFT LoRA adapter into host torch tensors, through the shared validating reader.

Adapter files come from tenants: they are opened and checked by `loraplane.adapters` (the same
code the control plane and operator run), never by a trusting loader. The scales honour
lora_alpha, use_rslora, rank_pattern and alpha_pattern as validation computed them.

An adapter of the other layout than its base's (split q/k/v and gate/up on Phi-3's fused
`qkv_proj` / `gate_up_proj`, or the fused names on a split base) is converted to the base's
layout as it is loaded (`base_layout`), so the pool, the LoRA layers and the kernels only ever
see the base's own modules.

A DoRA adapter's modules carry their magnitude vectors (`LoRAWeights.magnitude`, [out]) as
stored; the pool turns each into the per-row scale it serves with when it places the adapter
(`lora/dora.py`). Validation refused DoRA on modules a conversion would build.
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
from loraplane.adapters.canonical import canonical_digest, start_digest, stored_digest_start
from loraplane.adapters.errors import IntegrityError
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.locate import PACKED_MODULES, counterparts
from loraplane.adapters.packing import LoRAFactors, fuse, part_sizes, split
from loraplane.adapters.safetensors_io import (
    DTYPES,
    MAX_HEADER_BYTES,
    SafetensorsFile,
    TensorInfo,
)
from loraplane.adapters.source import AdapterFiles, open_adapter_source
from loraplane.adapters.validate import ModuleLoRA, ValidatedAdapter, validate_adapter


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


def _to_torch(weights: SafetensorsFile, name: str) -> torch.Tensor:
    """Copy one tensor out of the memory map (BF16 arrives as uint16 bit patterns)."""
    view: np.ndarray[Any, Any] = weights.array(name)
    copy = np.array(view, copy=True)
    if weights.tensors[name].dtype == "BF16":
        return torch.from_numpy(copy.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(copy)


READ_CHUNK = 8 << 20
# validated layouts remembered (see `_Layout`): adapters trained by one recipe share one
MAX_LAYOUTS = 64

_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


@dataclass(frozen=True, slots=True)
class _Layout:
    """What validating a stored version found, true of any file with the same config bytes,
    weights header bytes and size (validation reads nothing else, for a given base model and
    limits): the canonical config its digest starts with, and each module's tensors."""

    config: bytes
    # each module's A and B, and its DoRA magnitude vector (None: plain LoRA)
    modules: tuple[tuple[ModuleLoRA, TensorInfo, TensorInfo, TensorInfo | None], ...]


# (sha256 of the config and weights header bytes, weights file size, base model, limits)
_LayoutKey = tuple[bytes, int, BaseModelSpec, AdapterLimits]
_layouts: OrderedDict[_LayoutKey, _Layout] = OrderedDict()
_layouts_lock = threading.Lock()


def _layout_key(
    config: bytes, header: bytes, size: int, base: BaseModelSpec, limits: AdapterLimits
) -> _LayoutKey:
    """The memo's key: the bytes hashed, not kept (a header may be megabytes long)."""
    h = hashlib.sha256(len(config).to_bytes(8, "little"))
    h.update(config)
    h.update(header)
    return h.digest(), size, base, limits


def _known_layout(key: _LayoutKey) -> _Layout | None:
    with _layouts_lock:
        layout = _layouts.get(key)
        if layout is not None:
            _layouts.move_to_end(key)
        return layout


def _remember_layout(key: _LayoutKey, layout: _Layout) -> None:
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


def _weights(buf: np.ndarray[Any, Any], layout: _Layout) -> dict[tuple[int, str], LoRAWeights]:
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


def _load_known(
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
            layout = _known_layout(_layout_key(config, header, size, base, limits))
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
    return LoadedAdapter(source=source, modules=_weights(buf, layout), digest=digest)


def _read_stored(
    adapter: ValidatedAdapter, source: str
) -> tuple[LoadedAdapter, _Layout, bytes] | None:
    """A validated stored version's weights in one sequential read, hashed as they arrive
    (the digest is not checked here), with its layout and its weights header. None when
    the weights file is not canonical; OSError when it changed since it was validated."""
    h = stored_digest_start(adapter)
    if h is None:
        return None
    weights = adapter.weights
    header = weights.head(8 + int.from_bytes(weights.head(8), "little"))
    layout = _Layout(
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
    loaded = LoadedAdapter(source=source, modules=_weights(buf, layout), digest=h.hexdigest())
    return loaded, layout, header


def load_lora(
    path: Path | str,
    base: BaseModelSpec,
    limits: AdapterLimits | None = None,
    expected_digest: str | None = None,
) -> LoadedAdapter:
    """Validate and read the adapter at `path` (see `_load_lora`), in the base's layout
    (`base_layout`); on a mixture-of-experts base, packed experts' factors are split per
    expert (`lora/experts.py`)."""
    loaded = base_layout(_load_lora(path, base, limits, expected_digest), base)
    if not base.num_experts:
        return loaded
    return per_expert_modules(loaded, base)


def _as_float(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """`t` as a float32 numpy array (an fp32 tensor's own memory, not copied). In numpy, not
    torch: a torch cast of a large tensor on a loader thread would start an OpenMP team that
    competes with the engine's step for its cores (see `host_form.copy_serial`)."""
    if t.dtype == torch.bfloat16:  # the high half of an f32
        bits = t.view(torch.int16).numpy().view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32)
    array: np.ndarray[Any, Any] = t.numpy()
    return array if array.dtype == np.float32 else array.astype(np.float32)


def _as_tensor(array: np.ndarray[Any, Any], dtype: torch.dtype) -> torch.Tensor:
    """A float32 array back in `dtype` (bf16: rounded to nearest even, as torch casts)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == torch.bfloat16:
        bits = array.view(np.uint32)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # no NaN: validated finite
        return torch.from_numpy(rounded.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    if dtype == torch.float16:
        return torch.from_numpy(array.astype(np.float16))
    return torch.from_numpy(array)


def _factors(w: LoRAWeights) -> LoRAFactors:
    return LoRAFactors(_as_float(w.a), _as_float(w.b), w.scale)


def _from_factors(f: LoRAFactors, dtype: torch.dtype) -> LoRAWeights:
    return LoRAWeights(a=_as_tensor(f.a, dtype), b=_as_tensor(f.b, dtype), scale=f.scale)


def base_layout(adapter: LoadedAdapter, base: BaseModelSpec) -> LoadedAdapter:
    """`adapter` with its modules of the other layout converted to `base`'s own, rank-exact
    (`loraplane.adapters.packing`, as vLLM's packed-modules mapping places slices); returned
    as is when it has none.

    - split parts on a fused base (q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`): the
      parts' A's side by side along the rank, their B's block-diagonal, so the fused
      module's rank is the sum of the parts' ranks (one rank when they share one A); a part
      the adapter leaves out is zero rows of B. Validation refused a sum over the pool's
      max rank (`validate.check_served_rank`).
    - a fused name on a split base: each part keeps A and its rows of B (columns that are
      zero in those rows dropped, with A's matching rows); a part with no update is left out.

    The factors are converted in fp32 (numpy) and back to the adapter's dtype: placing slices
    is exact; only a part's scale differing from the first part's is folded into its B."""
    moving = {key: counterparts(base, *key) for key in adapter.modules}
    if all(served is None for served in moving.values()):
        return adapter
    modules: dict[tuple[int, str], LoRAWeights] = {}
    groups: dict[tuple[int, str], dict[str, LoRAWeights]] = {}
    for (layer, module), w in adapter.modules.items():
        served = moving[(layer, module)]
        if served is None:
            modules[(layer, module)] = w
        elif module in PACKED_MODULES:  # fused name, split base
            pieces = split(_factors(w), part_sizes(base, module))
            for part, piece in zip(served, pieces, strict=True):
                if piece is not None:
                    modules[(layer, part)] = _from_factors(piece, w.a.dtype)
        else:
            groups.setdefault((layer, served[0]), {})[module] = w
    for (layer, fused), parts in groups.items():
        names = PACKED_MODULES[fused]
        dtype = next(iter(parts.values())).a.dtype
        whole = fuse([_factors(parts[n]) if n in parts else None for n in names],
                     part_sizes(base, fused))  # fmt: skip
        modules[(layer, fused)] = _from_factors(whole, dtype)
    return LoadedAdapter(adapter.source, modules, adapter.digest)


def _load_lora(
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

    A stored version's validation is remembered by the exact bytes it read (config, weights
    header, file size) with the base model and limits: a later version with the same bytes
    there (adapters trained by one recipe differ only in their tensors' values) is read and
    digest-checked without validating again. Its digest covers every byte of both files, so
    nothing unchecked gets through; a cold load of such a version costs a read and a hash.
    """
    limits = limits or AdapterLimits()
    source = str(path)
    with open_adapter_source(path, limits) as files:
        if expected_digest is not None:
            known = _load_known(files, base, limits, expected_digest, source)
            if known is not None:
                return known
        adapter = validate_adapter(files, base, limits, scan_weights=expected_digest is None)
        if expected_digest is not None:
            try:
                stored = _read_stored(adapter, source)
            except BaseException:
                adapter.close()
                raise
            if stored is not None:
                adapter.close()
                loaded, layout, header = stored
                if loaded.digest != expected_digest:
                    raise IntegrityError(source, expected_digest, loaded.digest)
                key = _layout_key(adapter.config_bytes, header, adapter.weights.size, base, limits)
                _remember_layout(key, layout)
                return loaded
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
                    magnitude=_to_torch(adapter.weights, m.m_name) if m.m_name else None,
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


# one expert's (gate, up, down) names per family, as its checkpoint names them
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def per_expert_modules(adapter: LoadedAdapter, spec: BaseModelSpec) -> LoadedAdapter:
    """`adapter` with any packed experts' factors split into per-expert ones, keyed
    (layer, `experts.N.NAME`) as the pool and 4.x adapters key them; returned as is when it
    has none. A packed `experts.gate_up_proj` becomes N's gate and up linears, which share
    its A (gate: the first half of B's rows, up: the second, as the packed parameter's rows)."""
    names = EXPERT_NAMES.get(spec.model_type)
    packed = [key for key in adapter.modules if key[1] in ("experts.gate_up_proj",
                                                           "experts.down_proj")]  # fmt: skip
    if names is None or not packed:
        return adapter
    gate, up, down = names
    experts = spec.num_experts
    modules: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), w in adapter.modules.items():
        if module not in ("experts.gate_up_proj", "experts.down_proj"):
            modules[(layer, module)] = w
            continue
        rank = w.a.shape[0] // experts
        if rank * experts != w.a.shape[0] or w.b.shape[1] != w.a.shape[0]:
            raise ValueError(
                f"layer {layer} {module}: A {tuple(w.a.shape)} / B {tuple(w.b.shape)} do not "
                f"split into {experts} experts"
            )
        for e in range(experts):
            a = w.a[e * rank : (e + 1) * rank].contiguous()  # [r, in]
            b = w.b[:, e::experts].contiguous()  # [out, r]
            if module == "experts.down_proj":
                modules[(layer, f"experts.{e}.{down}")] = LoRAWeights(a, b, w.scale)
                continue
            half = b.shape[0] // 2
            modules[(layer, f"experts.{e}.{gate}")] = LoRAWeights(a, b[:half].contiguous(),
                                                                  w.scale)  # fmt: skip
            modules[(layer, f"experts.{e}.{up}")] = LoRAWeights(a, b[half:].contiguous(), w.scale)
    return LoadedAdapter(adapter.source, modules, adapter.digest)
