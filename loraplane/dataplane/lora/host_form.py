"""An adapter in a pool's host form: its A and B in the pool's dtype and layout (B transposed
where the CPU kernels read it so), back to back in one host buffer (pinned for a CUDA pool).

The loader threads convert each adapter they read (`LoRAPool.host_form` calls `convert`), so a
CPU slot reads the host copy in place and a CUDA slot copies it without conversion, and the
engine's step does none of that work. Into fp32 (CPU pools) the native library converts a whole
adapter in one call (`sgmv_cpu.convert_f32`); otherwise numpy copies each tensor within its
dtype and torch casts across dtypes, in pieces small enough not to start an OpenMP team on a
loader thread (`copy_serial`). The buffer is numpy's (`host_buffer`: huge pages). A stored
version already in a CPU pool's dtype needs no buffer: each B is transposed where the loader
read it (`_in_place`), so a cold load costs a read, a hash and B's transposition.
"""

from __future__ import annotations

import numpy as np
import torch

from loraplane.dataplane.kernels import sgmv_cpu
from loraplane.dataplane.lora.weights import LoadedAdapter, LoRAWeights

# ATen runs an element-wise op over this many elements or more on its OpenMP thread team
# (at::internal::GRAIN_SIZE). Started from a loader thread, such an op makes that thread a
# team of its own, whose threads then spin on the cores the engine's step computes on.
PARALLEL_GRAIN = 32768


def copy_serial(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for 1-D or 2-D tensors of one shape (any strides), in pieces small
    enough to run on the calling thread alone: how loader threads convert adapters without
    taking cores from the step."""
    if dst.shape != src.shape or dst.dim() not in (1, 2):
        raise ValueError(f"copy_serial needs 1-D or 2-D tensors of one shape: {dst.shape}, "
                         f"{src.shape}")  # fmt: skip
    if dst.numel() < PARALLEL_GRAIN:  # one op, serial already (most adapter tensors)
        dst.copy_(src)
        return
    piece = PARALLEL_GRAIN - 1
    if dst.dim() == 1:
        for i in range(0, dst.numel(), piece):
            dst[i : i + piece].copy_(src[i : i + piece])
        return
    rows, cols = dst.shape
    if cols > piece:  # rows longer than a piece: row by row
        for r in range(rows):
            copy_serial(dst[r], src[r])
        return
    step = max(1, piece // max(1, cols))
    for r in range(0, rows, step):
        dst[r : r + step].copy_(src[r : r + step])


def host_buffer(numel: int, dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
    """An uninitialised 1-D host tensor of `numel` elements: page-locked when `pinned` (a CUDA
    pool's copies), else numpy's memory. numpy asks the kernel for transparent huge pages for
    a buffer of 4 MiB or more (madvise); torch's allocator does not, and writing a fresh 80 MiB
    host form 4 KiB page by page cost as long as reading the adapter's file (benchmarks/tiers.py:
    the page faults were most of the conversion's time)."""
    if pinned:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.empty(numel * size, dtype=np.uint8)).view(dtype)


# an integer type of each element size: a copy within one dtype copies bits (bf16 has no numpy type)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) on the calling thread. Within one dtype, numpy copies the bits in one
    call (never an OpenMP team; a transposed B copies in about two thirds of torch's time);
    a cast goes through `copy_serial`'s pieces."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        copy_serial(dst, src)
        return
    bits = _BITS[dst.element_size()]
    np.copyto(dst.view(bits).numpy(), src.view(bits).numpy())


def _one_run(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, int] | None:
    """When `tensors` (host, one dtype, contiguous) lie back to back in one storage, covering
    one range of it once (the loader's views of a stored version's file): that range as one
    flat tensor, and its storage offset. Else None."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if (
            t.dtype != first.dtype
            or t.device.type != "cpu"
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
    ordered = sorted(tensors, key=lambda t: int(t.storage_offset()))
    start = end = int(ordered[0].storage_offset())
    for t in ordered:
        if t.storage_offset() != end:
            return None
        end += t.numel()
    return ordered[0].as_strided((end - start,), (1,)), start


def _own(magnitude: torch.Tensor | None) -> torch.Tensor | None:
    """A DoRA magnitude vector as an fp32 tensor of its own: not a view that would keep the
    loader's whole file buffer alive beside the converted host copy."""
    if magnitude is None:
        return None
    own = torch.empty(magnitude.shape, dtype=torch.float32)
    copy_serial(own, magnitude)
    return own


def _dense(t: torch.Tensor, transposed_b: bool) -> bool:
    return t.t().is_contiguous() if transposed_b else t.is_contiguous()


def is_host_form(adapter: LoadedAdapter, dtype: torch.dtype, transposed: bool) -> bool:
    """Whether `adapter` already is in the host form `convert` makes."""
    return all(
        t.dtype == dtype and t.device.type == "cpu" and _dense(t, transposed and role == "b")
        for w in adapter.modules.values()
        for role, t in (("a", w.a), ("b", w.b))
    )


def convert(
    adapter: LoadedAdapter, dtype: torch.dtype, *, transposed: bool, cuda: bool
) -> LoadedAdapter:
    """`adapter` with its A and B in `dtype`, each B the [out, r] view of a dense [r, out]
    where `transposed`, back to back in one host buffer (pinned when `cuda`); returned as is
    when already in that form, and converted where it lies (returned itself) when it owns its
    tensors and only B's layout differs (`_in_place`)."""
    if is_host_form(adapter, dtype, transposed):
        return adapter
    if _in_place(adapter, dtype, transposed, cuda):
        return adapter
    tensors = [t for w in adapter.modules.values() for t in (w.a, w.b)]
    buffer = host_buffer(sum(t.numel() for t in tensors), dtype, pinned=cuda)
    parts = [(t, transposed and i % 2 == 1) for i, t in enumerate(tensors)]
    if not cuda and sgmv_cpu.convert_f32(parts, buffer):  # one C call
        return _views_of(adapter, buffer, transposed)
    run = None if transposed else _one_run(tensors)
    if run is not None:  # a stored version as the loader reads it: one conversion
        whole, start = run
        _copy(buffer, whole)
        offsets = [int(t.storage_offset()) - start for t in tensors]
        views = iter(  # tensors holds each module's A then B
            buffer[o : o + t.numel()].view(t.shape) for o, t in zip(offsets, tensors, strict=True)
        )
        modules = {
            key: LoRAWeights(next(views), next(views), w.scale, _own(w.magnitude))
            for key, w in adapter.modules.items()
        }
        return LoadedAdapter(adapter.source, modules, adapter.digest)
    host = _views_of(adapter, buffer, transposed)  # then two copies per module
    for w, h in zip(adapter.modules.values(), host.modules.values(), strict=True):
        _copy(h.a, w.a)
        _copy(h.b, w.b)
    return host


def _in_place(adapter: LoadedAdapter, dtype: torch.dtype, transposed: bool, cuda: bool) -> bool:
    """Put `adapter` in a CPU pool's transposed host form where it lies, when it owns its
    tensors (a stored version as the loader read it) and they are dense in `dtype` already:
    each B is transposed within its own bytes (through a small copy of it) and the modules
    take the [out, r] views of those dense [r, out]. No second buffer, no copy of A: the file
    buffer becomes the host form, as it was before CPU pools transposed B. False, with
    nothing changed, otherwise."""
    if not (adapter.owns_tensors and transposed and not cuda):
        return False
    for w in adapter.modules.values():
        for t in (w.a, w.b):
            if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
                return False
    bits = _BITS[torch.empty(0, dtype=dtype).element_size()]
    for key, w in list(adapter.modules.items()):
        fan_out, rank = w.b.shape
        b = w.b.view(bits).numpy()  # [out, r], the stored layout
        np.copyto(b.reshape(rank, fan_out), b.copy().T)  # the same bytes as [r, out]
        b_t = w.b.view(-1).view(rank, fan_out).t()  # [out, r] view of the dense [r, out]
        adapter.modules[key] = LoRAWeights(w.a, b_t, w.scale, _own(w.magnitude))
    return True


def _views_of(adapter: LoadedAdapter, buffer: torch.Tensor, transposed: bool) -> LoadedAdapter:
    """`adapter`'s modules as views of `buffer`, each A then B back to back in module order,
    each B a [out, r] view of a dense [r, out] where `transposed`."""
    modules = {}
    offset = 0
    for key, w in adapter.modules.items():
        (rank, fan_in), (fan_out, _) = w.a.shape, w.b.shape
        a = buffer.as_strided((rank, fan_in), (fan_in, 1), offset)
        offset += rank * fan_in
        b_strides = (1, fan_out) if transposed else (rank, 1)
        b = buffer.as_strided((fan_out, rank), b_strides, offset)
        offset += fan_out * rank
        modules[key] = LoRAWeights(a=a, b=b, scale=w.scale, magnitude=_own(w.magnitude))
    return LoadedAdapter(adapter.source, modules, adapter.digest)
