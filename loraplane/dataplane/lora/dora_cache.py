"""DoRA's per-row scales for a pool's host copy, made on the loader threads and kept per node.

`with_norms` gives each DoRA module of a host copy its g = m / ||W + s B A||_row
(`dora.DoRAWeights`, all of an adapter's g back to back in one fp32 host buffer, pinned for a
CUDA pool), computed from the pool's base weights on the pool's device (`dora.dora_scale`):
`LoRAPool.host_form` calls it, on the manager's loader threads, so filling a slot on the
engine thread only copies g (on CPU, reads it in place).

`NormCache` keeps what was computed so a load again does not recompute it: in memory (LRU by
bytes: a host copy evicted and needed again) and, given a folder, on disk (a pod restarted
with that folder kept), one safetensors file per key: the engine gives it `NORM_FOLDER` in the
disk tier's root (tiers/disk.py) when adapters come from a remote store. The key (`norm_key`)
hashes the adapter's canonical digest, the pool's dtype (A and B are rounded to it before the
norm), each DoRA module's name, rank, scale and a fingerprint of its base weight
(`dora.base_print`). A file is written to a temporary name and renamed, and read
defensively: a missing module, a shape or dtype not the expected one, a value not finite, or
a file that does not parse, and g is computed again (the bad file removed), never served. A g
that is not finite everywhere (a row of W + s B A all zero: PEFT's inf) is served but not
kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from loraplane.dataplane.lora import dora
from loraplane.dataplane.lora.weights import LoadedAdapter

if TYPE_CHECKING:
    from loraplane.dataplane.lora.module_slots import ModuleSlots

log = logging.getLogger(__name__)
# the cache's folder in a disk tier's root (model_runner.py; not a digest: the tier skips it)
NORM_FOLDER = "dora-norms"
FORMAT = b"loraplane-dora-norms-v1"  # in every key: a change of what g means changes it
SUFFIX = ".safetensors"

Scales = dict[str, torch.Tensor]  # "layer.module" -> g [out] fp32 on the host


def _name(layer: int, module: str) -> str:
    return f"{layer}.{module}"


def module_print(table: ModuleSlots) -> bytes:
    """The fingerprint of `table`'s base weight (`dora.base_print`), computed once and kept
    with its row norms (two loader threads may both compute it: the same bytes)."""
    if table.base_print is None:
        weight = dora.base_weight(table.base)
        if weight is None:
            raise ValueError("no base weight for DoRA")
        if table.base_sq is None:
            table.base_sq = dora.row_norms_sq(weight)
        table.base_print = dora.base_print(weight, table.base_sq)
    return table.base_print


def norm_key(
    adapter: LoadedAdapter, tables: dict[tuple[int, str], ModuleSlots], dtype: torch.dtype
) -> str | None:
    """The cache key of `adapter`'s g in a pool of `dtype` over `tables`' base weights; None
    for an adapter without a canonical digest (built in memory: nothing names its content)."""
    if not adapter.digest:
        return None
    h = hashlib.sha256(FORMAT)
    h.update(f"\0{adapter.digest}\0{dtype}".encode())
    for (layer, module), w in sorted(adapter.modules.items()):
        if w.magnitude is None:
            continue
        h.update(f"\0{_name(layer, module)} r={w.rank} s={w.scale!r} {tuple(w.b.shape)}".encode())
        h.update(module_print(tables[(layer, module)]))
    return h.hexdigest()


class NormCache:
    """g per DoRA module of an adapter, by `norm_key`: in memory within `memory_bytes` and,
    with a `root` folder, on disk within `disk_bytes` (least recently used out first)."""

    def __init__(
        self,
        root: Path | str | None = None,
        memory_bytes: int = 64 << 20,
        disk_bytes: int = 1 << 30,
    ) -> None:
        if memory_bytes < 0 or disk_bytes <= 0:
            raise ValueError(f"byte budgets must be positive: {memory_bytes}, {disk_bytes}")
        self.root = Path(root) if root is not None else None
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        self.memory_bytes, self.disk_bytes = memory_bytes, disk_bytes
        self._memory: OrderedDict[str, tuple[Scales, int]] = OrderedDict()  # key -> g, bytes
        self._memory_used = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.rejected = 0  # rejected: a file found but not served

    def _path(self, key: str) -> Path:
        assert self.root is not None
        return self.root / f"{key}{SUFFIX}"

    def get(self, key: str, rows: dict[str, int]) -> Scales | None:
        """The g of each module `rows` names (name -> its [rows] fp32), or None: not kept,
        or a kept copy that is not exactly that (then removed)."""
        with self._lock:
            held = self._memory.get(key)
            if held is not None:
                self._memory.move_to_end(key)
                self.hits += 1
                return held[0]
        found = self._read(key, rows)
        with self._lock:
            if found is None:
                self.misses += 1
                return None
            self.hits += 1
            self._remember(key, found)
        return found

    def _read(self, key: str, rows: dict[str, int]) -> Scales | None:
        if self.root is None:
            return None
        path = self._path(key)
        why: str | None
        try:
            found = load_file(path)
        except FileNotFoundError:
            return None
        except Exception as e:  # a torn or foreign file: computed again
            why = f"unreadable ({type(e).__name__})"
        else:
            why = _wrong(found, rows)
        if why is not None:
            log.warning("DoRA norm cache: %s is %s; computing g again", path.name, why)
            with self._lock:
                self.rejected += 1
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: evicted last
        return found

    def put(self, key: str, scales: Scales) -> None:
        """Keep `scales` (each [out] fp32, host) under `key`, unless a value is not finite."""
        if not bool(torch.isfinite(torch.cat(list(scales.values()))).all()):
            return
        with self._lock:
            self._remember(key, scales)
        if self.root is None:
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            os.close(fd)
            try:
                save_file({n: g.contiguous().clone() for n, g in scales.items()}, tmp)
                os.replace(tmp, self._path(key))  # readers see the whole file or none
            finally:
                Path(tmp).unlink(missing_ok=True)
            self._evict_disk()
        except OSError as e:  # a full or read-only disk costs a recomputation, not a load
            log.warning("DoRA norm cache: cannot write %s: %s", key[:12], e)

    def _remember(self, key: str, scales: Scales) -> None:
        old = self._memory.pop(key, None)
        if old is not None:
            self._memory_used -= old[1]
        nbytes = sum(g.nbytes for g in scales.values())
        self._memory[key] = (scales, nbytes)
        self._memory_used += nbytes
        while self._memory_used > self.memory_bytes and self._memory:
            self._memory_used -= self._memory.popitem(last=False)[1][1]

    def _evict_disk(self) -> None:
        assert self.root is not None
        files = []
        for path in self.root.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another process removed it
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.disk_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


def _wrong(found: Scales, rows: dict[str, int]) -> str | None:
    """Why a kept copy is not the g of the modules `rows` names (None: it can be)."""
    if set(found) != set(rows):
        return "not the adapter's DoRA modules"
    for name, g in found.items():
        if g.dtype != torch.float32 or tuple(g.shape) != (rows[name],):
            return f"{name}: {g.dtype} {tuple(g.shape)}"
    if not bool(torch.isfinite(torch.cat(list(found.values()))).all()):
        return "a value not finite"
    return None


def with_norms(
    adapter: LoadedAdapter,
    tables: dict[tuple[int, str], ModuleSlots],
    dtype: torch.dtype,
    cache: NormCache | None,
    pin: bool,
    skip: Callable[[tuple[int, str]], bool] | None = None,
) -> LoadedAdapter:
    """`adapter` (a host copy in the pool's `dtype`) with each DoRA module a
    `dora.DoRAWeights` carrying its g, read from `cache` or computed from the base weights
    `tables` registered (on their device) and then kept there; as is without DoRA modules
    or when each already carries its g. Modules `skip` names are left as they are (a
    row-parallel rank's: their g is summed over the ranks at placement, pool.sync_norms)."""
    keys = [k for k, w in adapter.modules.items() if w.magnitude is not None]
    if skip is not None:
        keys = [k for k in keys if not skip(k)]
    if all(isinstance(adapter.modules[k], dora.DoRAWeights) for k in keys):
        return adapter
    if any(k not in tables for k in keys):  # not this model's: the pool's load says so
        return adapter
    rows = {_name(*k): int(adapter.modules[k].b.shape[0]) for k in keys}
    key = norm_key(adapter, tables, dtype) if cache is not None else None
    found = cache.get(key, rows) if cache is not None and key is not None else None
    if found is None:
        found = {_name(*k): _compute(adapter, tables, k) for k in keys}
        if cache is not None and key is not None:
            cache.put(key, found)
    buffer = torch.empty(sum(rows.values()), dtype=torch.float32)  # [sum of out]
    if pin:
        buffer = buffer.pin_memory()
    modules = dict(adapter.modules)
    offset = 0
    for k in keys:
        w, n = adapter.modules[k], rows[_name(*k)]
        g = buffer[offset : offset + n]
        g.copy_(found[_name(*k)])
        offset += n
        modules[k] = dora.DoRAWeights(a=w.a, b=w.b, scale=w.scale, magnitude=w.magnitude, g=g)
    return LoadedAdapter(adapter.source, modules, adapter.digest)


def _compute(
    adapter: LoadedAdapter, tables: dict[tuple[int, str], ModuleSlots], key: tuple[int, str]
) -> torch.Tensor:  # [out] fp32 on the host
    w, table = adapter.modules[key], tables[key]
    weight = dora.base_weight(table.base)
    if w.magnitude is None or weight is None:
        raise ValueError(f"layer {key[0]} {key[1]}: no base weight for DoRA")
    if table.base_sq is None:  # the first DoRA adapter here: ||W_i||^2, kept
        table.base_sq = dora.row_norms_sq(weight)
    a, b = w.a.to(weight.device), w.b.to(weight.device)
    return dora.dora_scale(weight, a, b, w.scale, w.magnitude, table.base_sq).cpu()
