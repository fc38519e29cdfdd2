"""The native CPU SGMV kernel (`sgmv_cpu.c`): one C call per (layer, module) of a step.

The torch path (`sgmv_torch.lora_apply_grouped`) dispatches two small matmuls per segment from
Python; with tens of adapters in a step that per-segment cost, not arithmetic, is most of the
LoRA layers' time. The kernel loops over the segments in C, reads each adapter's A and B^T
once per four tokens, and adds straight into the layer's output (`benchmarks/lora_cpu.py`).

Where `$LORAPLANE_KERNEL_PREBUILT` names a folder of portable builds (`sgmv_cpu_prebuilt`: the
image ships one, built in its build stage), the best one this CPU runs is loaded from there.
Else (no folder, none fits, a stale or corrupt one: a warning says which) it is compiled on
first use with the system C compiler (`$CC`, else `cc`; -O3 -march=native) into a cache folder
(`$LORAPLANE_KERNEL_CACHE`, else `~/.cache/loraplane/kernels`, else the temp folder), keyed by
the source, the flags and this CPU, and loaded with ctypes. Where there is no compiler or the
build fails, one warning says why and the torch path serves. `loaded()` says which library the
process runs (an info line logs it too).

`lora_apply` takes fp32 CPU tensors whose slots hold B transposed (`LoRAPool.b_transposed`)
and answers False for anything else, so the caller falls back. It checks every slot it reads
(shapes against the layer, as the torch path does, raising ValueError on a misfit) and keeps a
reference to the tensors whose addresses it handed to C, so none is freed under it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from loraplane.dataplane.kernels import sgmv_cpu_prebuilt as prebuilt
from loraplane.dataplane.kernels.sgmv_torch import checked_pair

if TYPE_CHECKING:
    from loraplane.dataplane.lora.metadata import LoRABatch
    from loraplane.dataplane.lora.module_slots import ModuleSlots

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("sgmv_cpu.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
# with torch's OpenMP runtime (libgomp) in the process, the kernel splits a call over its
# team; else it runs on the calling thread (only its loops vectorised by OpenMP's simd)
OPENMP, SERIAL = ("-fopenmp",), ("-fopenmp-simd",)
MAX_RANK = 256  # the kernel's (sgmv_cpu.c)
# segments longer than this go to a GEMM: a long prompt of one adapter is a matrix product
# that BLAS does better than four tokens at a time, and the kernel gives one segment one thread
# (`split`). Up to 128 tokens the kernel is ahead (2-core AVX2 EPYC, 2 threads, q and v of
# hidden 576, rank 16, the kernel's time over the GEMM path's: 1 x 128 tokens 0.82, 2 x 96 0.65,
# 8 x 128 0.52; at hidden 1024 1 x 256 1.12, 1 x 512 1.49 but 4 x 256 0.53)
MAX_SEGMENT = 128
PREBUILT_ENV = "LORAPLANE_KERNEL_PREBUILT"
_build_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Loaded:
    """The library this process runs: `prebuilt` (with its variant) or `compiled` here."""

    origin: str  # prebuilt | compiled
    path: Path
    variant: str  # x86-64-v3, baseline, ... (prebuilt) or native (compiled)
    threading: str  # openmp | serial


_loaded: Loaded | None = None


def loaded() -> Loaded | None:
    """Which library `library()` loaded; None before it ran, or where the torch path serves."""
    return _loaded if library() is not None else None


def _cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo's first `flags` line); empty where unreadable."""
    _, _, flags = _cpu_key().partition(":")
    return frozenset(flags.split())


def _cpu_key() -> str:
    """What -march=native compiles for: the machine and its CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _cache_dirs() -> list[Path]:
    configured = os.environ.get("LORAPLANE_KERNEL_CACHE")
    if configured:
        return [Path(configured)]
    return [Path.home() / ".cache" / "loraplane" / "kernels", Path(tempfile.gettempdir())]


def _build(compiler: str, extra: tuple[str, ...]) -> Path:
    """The compiled library with FLAGS and `extra` (OPENMP or SERIAL, and any -D), from the
    cache or built now (OSError or CalledProcessError)."""
    source = SOURCE.read_bytes()
    flags = (*FLAGS, *extra)
    key = hashlib.sha256(source + " ".join((compiler, *flags, _cpu_key())).encode()).hexdigest()
    name = f"loraplane-sgmv-cpu-{key[:16]}.so"
    errors = []
    for folder in _cache_dirs():
        target = folder / name
        if target.is_file():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=folder, prefix=name, suffix=".part")
            os.close(fd)
        except OSError as e:
            errors.append(f"{folder}: {e}")
            continue
        try:
            subprocess.run([compiler, *flags, "-o", partial, str(SOURCE), "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
            os.replace(partial, target)  # whole or not at all, for a concurrent builder
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return target
    raise OSError("no writable kernel cache folder: " + "; ".join(errors))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built and loaded once per process; None (with a warning) where it cannot
    be, or where `LORAPLANE_SGMV_NATIVE=0` turns it off."""
    global _loaded
    _loaded = None
    if os.environ.get("LORAPLANE_SGMV_NATIVE", "1").strip() == "0":
        return None
    folder = os.environ.get(PREBUILT_ENV, "").strip()
    if folder:
        found = _prebuilt(Path(folder), _threading())
        if found is not None:
            lib, _loaded = found
            log.info("the native CPU LoRA kernel: prebuilt %s (%s), %s", _loaded.variant,
                     _loaded.threading, _loaded.path)  # fmt: skip
            return lib
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("no C compiler (%s) for the native CPU LoRA kernel: the torch path serves",
                    compiler)  # fmt: skip
        return None
    with _build_lock:
        threading_flags = _threading()
        try:
            try:
                path = _build(compiler, threading_flags)
            except subprocess.CalledProcessError:
                if threading_flags == SERIAL:
                    raise
                log.info("the native CPU LoRA kernel did not build with OpenMP: it runs on one "
                         "thread")  # fmt: skip
                threading_flags = SERIAL
                path = _build(compiler, SERIAL)
            lib = ctypes.CDLL(str(path))
        except subprocess.CalledProcessError as e:
            log.warning("the native CPU LoRA kernel did not build (the torch path serves): %s",
                        (e.stderr or "").strip()[-2000:])  # fmt: skip
            return None
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("the native CPU LoRA kernel is unavailable (the torch path serves): %s", e)
            return None
    threads = "openmp" if threading_flags == OPENMP else "serial"
    _loaded = Loaded("compiled", path, "native", threads)
    log.info("the native CPU LoRA kernel: compiled here (-march=native, %s), %s", threads, path)
    return _declare(lib)


def _prebuilt(folder: Path, threading_flags: tuple[str, ...]) -> tuple[ctypes.CDLL, Loaded] | None:
    """The best library of a prebuilt folder that this CPU runs, loaded; None, with a warning
    saying why, where the folder is absent, stale (another source or machine), has none that
    fits, or the one that fits does not load (then the caller compiles)."""
    why = "falling back to compiling it"
    try:
        manifest = json.loads((folder / prebuilt.MANIFEST).read_text())
        libraries = list(manifest["libraries"])
        stale = manifest["source_sha256"] != prebuilt.source_digest()
        machine = manifest["machine"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("no prebuilt native CPU LoRA kernel in %s=%s (%s): %s", PREBUILT_ENV, folder,
                    e, why)  # fmt: skip
        return None
    if stale or machine != platform.machine():
        what = "another sgmv_cpu.c" if stale else f"another machine ({machine})"
        log.warning("the prebuilt native CPU LoRA kernels in %s were built from %s: %s", folder,
                    what, why)  # fmt: skip
        return None
    # with torch's OpenMP runtime loaded an OpenMP build joins its team; without it only a
    # serial one loads (an OpenMP one would pull in a second runtime)
    wanted = ("openmp", "serial") if threading_flags == OPENMP else ("serial",)
    cpu = _cpu_flags()
    # the manifest lists the best level first, OpenMP before serial within a level
    fits = [entry for entry in libraries
            if isinstance(entry, dict) and entry.get("threading") in wanted
            and set(entry.get("cpu_flags", ())) <= cpu]  # fmt: skip
    if not fits:
        log.warning("none of the prebuilt native CPU LoRA kernels in %s runs on this CPU: %s",
                    folder, why)  # fmt: skip
        return None
    entry = fits[0]
    path = folder / str(entry.get("file", ""))
    try:
        lib = _declare(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as e:
        log.warning("the prebuilt native CPU LoRA kernel %s does not load (%s): %s", path, e, why)
        return None
    return lib, Loaded("prebuilt", path, str(entry["variant"]), str(entry["threading"]))


def _threading() -> tuple[str, ...]:
    """OPENMP where this process runs GNU OpenMP already (torch's libgomp.so.1: the library
    then shares torch's thread team instead of starting a second one to fight it for the
    cores); SERIAL otherwise. (`library` falls back to SERIAL where OPENMP does not build.)"""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return SERIAL
    if "libgomp" not in maps:
        return SERIAL
    return OPENMP


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with its functions' argument and result types set."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.loraplane_sgmv_f32.argtypes = [p, i64, p, i64, i64, i64, p, p, p, i64, i64, p, i64, p,
                                       i64]  # fmt: skip
    lib.loraplane_sgmv_f32.restype = ctypes.c_int
    lib.loraplane_host_form_f32.argtypes = [p, i64, p]
    lib.loraplane_host_form_f32.restype = ctypes.c_int
    f32 = ctypes.c_float
    decode = lib.loraplane_decode_attention_f32
    decode.argtypes = [p, i64, p, p, i64, p, i64, p, p, i64, i64, i64, i64, f32, f32, i64, p,
                       i64, i64]  # fmt: skip
    decode.restype = ctypes.c_int
    lib.loraplane_rms_norm_f32.argtypes = [p, i64, p, i64, p, p, i64, i64, i64, f32, i64]
    lib.loraplane_rms_norm_f32.restype = None
    lib.loraplane_rope_f32.argtypes = [p, i64, i64, p, i64, i64, i64, p, p, i64, i64, i64]
    lib.loraplane_rope_f32.restype = None
    lib.loraplane_linear_lora_f32.argtypes = [p, i64, p, i64, i64, p, p, p]
    lib.loraplane_linear_lora_f32.restype = ctypes.c_int
    lib.loraplane_linear_lanes.argtypes = []
    lib.loraplane_linear_lanes.restype = i64
    return lib


# the conversion's codes for the dtypes adapter files hold (sgmv_cpu.c)
_SOURCE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def convert_f32(parts: list[tuple[torch.Tensor, bool]], out: torch.Tensor,
                lib: ctypes.CDLL | None = None) -> bool:  # fmt: skip
    """Write each 2-D tensor of `parts` into the fp32 CPU tensor `out`, back to back in their
    order, as fp32, transposed where its flag says (a [rows, cols] as a dense [cols, rows]): in
    one C call, which lets go of the GIL. False, with nothing written, when the library is not
    there or a tensor is not a contiguous 2-D CPU fp32, fp16 or bf16 one, or `out` is not a
    contiguous fp32 CPU tensor of exactly their size; the caller then converts with torch."""
    if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        return False  # (checked first: a GPU pool's fp16 or bf16 host form builds nothing)
    lib = lib or library()
    if lib is None:
        return False
    table = np.empty((len(parts), 6), dtype=np.int64)
    offset = 0
    for k, (t, transpose) in enumerate(parts):
        code = _SOURCE_DTYPES.get(t.dtype)
        if code is None or t.dim() != 2 or t.device.type != "cpu" or not t.is_contiguous():
            return False
        rows, cols = t.shape
        table[k] = (t.data_ptr(), code, rows, cols, transpose, offset)
        offset += rows * cols
    if offset != out.numel():
        return False
    status = lib.loraplane_host_form_f32(table.ctypes.data, len(parts), out.data_ptr())
    if status:  # pragma: no cover - every dtype was checked above
        raise RuntimeError(f"the native conversion failed ({status})")
    return True


class NativeTable:
    """One (layer, module)'s slots as the kernel reads them: [3, slots] int64 (A pointers,
    B^T pointers, ranks), and the tensors those pointers belong to."""

    def __init__(self, num_slots: int, scales: torch.Tensor) -> None:
        # numpy, not torch: written between and during steps, inference mode or not
        self.table = np.zeros((3, num_slots), dtype=np.int64)
        self.address = int(self.table.ctypes.data)  # the table's, for every call
        self.held: list[tuple[torch.Tensor | None, torch.Tensor | None]]
        self.held = [(None, None)] * num_slots
        # the fused call's `slots` words (sgmv_cpu.c loraplane_linear_lora_f32): the table,
        # its slots, the module's scales (a tensor made once per ModuleSlots)
        self.scales = scales
        self.words = np.array([self.address, num_slots, scales.data_ptr()], dtype=np.int64)
        self.words_address = int(self.words.ctypes.data)
        # (stamp, segment slots) of the last `current_at` that found every entry current
        self.seen: tuple[int, tuple[int, ...]] | None = None

    def current(self, slots: ModuleSlots, used: tuple[int, ...], x: torch.Tensor,
                y: torch.Tensor) -> bool:  # fmt: skip
        """Bring the entries of the slots in `used` up to date; False when one holds tensors
        the kernel cannot read (a layout, dtype or rank it does not take)."""
        for k in used:
            a, b = slots.lora_a[k], slots.lora_b[k]
            held = self.held[k]
            if held[0] is a and held[1] is b:
                continue
            if a is None or b is None:
                self.table[:, k] = 0
            else:
                pair = checked_pair(k, a, b, x, y)  # ValueError when they do not fit
                if (
                    a.dtype != torch.float32
                    or b.dtype != torch.float32
                    or a.device.type != "cpu"
                    or not a.is_contiguous()
                    or not pair.b_t.is_contiguous()
                    or a.shape[0] > MAX_RANK
                ):
                    return False
                self.table[0, k] = a.data_ptr()
                self.table[1, k] = b.data_ptr()
                self.table[2, k] = a.shape[0]
            self.held[k] = (a, b)
        return True

    def current_at(self, stamp: int, slots: ModuleSlots, used: tuple[int, ...], x: torch.Tensor,
                   y: torch.Tensor) -> bool:  # fmt: skip
        """`current`, skipped where it already held at this pool stamp for these slots (the
        stamp moves with every load and free: LoRAContext.stamp)."""
        key = (stamp, used)
        if self.seen == key:
            return True
        ok = self.current(slots, used, x, y)
        self.seen = key if ok else None
        return ok

    def forget(self, slot: int) -> None:
        """Drop a freed slot's entry and its tensors."""
        self.table[:, slot] = 0
        self.held[slot] = (None, None)
        self.seen = None


def native_table(slots: ModuleSlots) -> NativeTable:
    """The module's native slot table, made on first use (and again if its slots grew)."""
    native = slots.native
    if (
        native is None
        or native.table.shape[1] != len(slots.lora_a)
        or native.scales is not slots.scales
    ):
        native = slots.native = NativeTable(len(slots.lora_a), slots.scales)
    return native


def lora_apply(y: torch.Tensor, x: torch.Tensor, batch: LoRABatch, slots: ModuleSlots) -> bool:
    """`dispatch.lora_apply` through the kernel: True when done, False when the kernel does not
    take these tensors (the caller then runs the torch path; nothing was written)."""
    lib = library()
    if (
        lib is None
        or x.dtype != torch.float32
        or y.dtype != torch.float32
        or x.device.type != "cpu"
        or y.device.type != "cpu"
        or x.dim() != 2
        or y.dim() != 2
        or x.stride(1) != 1
        or y.stride(1) != 1
    ):
        return False
    native = native_table(slots)
    if not native.current(slots, batch.seg_slots, x, y):
        return False
    args = batch.native_args
    if args is None:
        args = _batch_args(batch)
        if not args:
            return False
    segments, threads = args[:5], args[5]
    status = lib.loraplane_sgmv_f32(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1], y.shape[1],
        *segments, native.address, len(native.held), slots.scales.data_ptr(), threads,
    )  # fmt: skip
    finish(status, y, x, batch, slots)
    return True


def finish(status: int, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch,
           slots: ModuleSlots) -> None:  # fmt: skip
    """What follows a native LoRA call that returned `status` (sgmv_cpu.c): a negative one is an
    error (a rank over MAX_RANK: the callers check ranks first), a positive one the number of
    segments it left to a matrix product, done here."""
    if status < 0:  # pragma: no cover - ranks were checked by the caller
        raise RuntimeError(f"the native CPU LoRA kernel failed ({status})")
    if status:
        _long_segments(y, x, batch, slots)


def _batch_args(batch: LoRABatch) -> tuple[int, ...]:
    """What every call of the step passes the kernel about its segments (kept on the batch):
    token order, segment slots and bounds, their count, MAX_SEGMENT, and the threads; () when
    the batch's tensors are not ones the kernel reads."""
    order, seg_slots, bounds = batch.token_order, batch.seg_slots_t, batch.seg_bounds_t
    if (
        order.dtype != torch.int64
        or seg_slots.dtype != torch.int32
        or bounds.dtype != torch.int32
        or any(t.device.type != "cpu" or not t.is_contiguous() for t in (order, seg_slots, bounds))
    ):
        args: tuple[int, ...] = ()
    else:
        args = (order.data_ptr(), seg_slots.data_ptr(), bounds.data_ptr(), len(batch.seg_slots),
                MAX_SEGMENT, torch.get_num_threads())  # fmt: skip
        # the fused call's `step` words (sgmv_cpu.c): the same five, kept with their address
        words = np.array(args[:5], dtype=np.int64)
        object.__setattr__(batch, "native_step", (words, int(words.ctypes.data)))
    object.__setattr__(batch, "native_args", args)
    return args


def _long_segments(y: torch.Tensor, x: torch.Tensor, batch: LoRABatch, slots: ModuleSlots) -> None:
    """The segments the kernel left (longer than MAX_SEGMENT tokens), as matrix products."""
    bounds = batch.seg_bounds
    for s, k in enumerate(batch.seg_slots):
        start, end = bounds[s], bounds[s + 1]
        a, b = slots.lora_a[k], slots.lora_b[k]
        if end - start <= MAX_SEGMENT or a is None or b is None:
            continue
        rows = batch.token_order[start:end]
        delta = (x.index_select(0, rows) @ a.t()) @ b.t()
        y.index_add_(0, rows, delta, alpha=float(slots.scales[k]))
