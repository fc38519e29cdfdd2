"""The workers' parts of an adapter as rank 0 keeps and ships them: one flat buffer each.

Rank 0's loader thread reads and validates an adapter once, splits it for every rank
(`shard.shard_adapter`) and packs each worker's part into a `PackedPart`: its A and B in the
pool's dtype and layout, back to back in one numpy buffer, and where each lies. Pickled (the
gloo scatter at placement) that is one copy of the buffer's bytes; torch tensors that view one
storage would each pickle the whole storage again. A worker unpacks its part into views of the
buffer, already in its pool's host form (`LoRAPool.host_form` returns it as it is).

On the wire (`wire`): every rank's part has the same layout (equal splits), so the step
message carries it once, and each worker's buffer goes to it alone as raw bytes (gloo
send/recv, no pickling: a third to a tenth of a pickled scatter's time, benchmarks in
docs/dataplane.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraplane.dataplane.lora.host_form import copy_serial
from loraplane.dataplane.lora.weights import LoadedAdapter, LoRAWeights
from loraplane.dataplane.parallel.shard import Heads, TPShard, shard_adapter


@dataclass(frozen=True, slots=True)
class PackedModule:
    """One module's factors in a `PackedPart`'s buffer, offsets in elements of its dtype."""

    layer: int
    module: str
    rank: int
    fan_in: int
    fan_out: int
    a_at: int  # A: [rank, fan_in] from here
    b_at: int  # B: [fan_out, rank], or its transpose [rank, fan_out] stored dense (transposed)
    scale: float
    m_at: int = -1  # DoRA's magnitude: fan_out fp32 values from here in the fp32 tail; -1: none


@dataclass(frozen=True, slots=True)
class PackedPart:
    """One rank's part of a validated adapter."""

    source: str
    digest: str
    dtype: torch.dtype
    transposed: bool  # B stored as a dense [rank, fan_out] (a CPU pool's layout)
    buffer: np.ndarray  # uint8, every A and B back to back, then the fp32 tail
    modules: tuple[PackedModule, ...]
    tail: int = 0  # byte offset of the fp32 tail: DoRA's magnitudes (fp32 in host copies)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer."""
        return int(self.buffer.nbytes)


def pack(part: LoadedAdapter, dtype: torch.dtype, transposed: bool) -> PackedPart:
    """`part`'s A and B in `dtype` (B transposed where `transposed`), and a DoRA module's
    magnitude in fp32 after them, in one buffer. Copies run on the calling thread alone
    (`copy_serial`: a loader thread takes no OpenMP team)."""
    size = torch.empty(0, dtype=dtype).element_size()
    numel = sum(w.a.numel() + w.b.numel() for w in part.modules.values())
    tail = -(-numel * size // 4) * 4  # the fp32 tail starts 4-byte aligned
    floats = sum(int(w.b.shape[0]) for w in part.modules.values() if w.magnitude is not None)
    buffer = np.empty(tail + 4 * floats, dtype=np.uint8)
    flat = torch.from_numpy(buffer[: numel * size]).view(dtype)
    magnitudes = torch.from_numpy(buffer[tail:]).view(torch.float32)
    modules, at, m_at = [], 0, 0
    for (layer, module), w in part.modules.items():
        rank, fan_in, fan_out = w.rank, int(w.a.shape[1]), int(w.b.shape[0])
        a_at, b_at = at, at + w.a.numel()
        copy_serial(flat[a_at:b_at].view(rank, fan_in), w.a)
        b = flat[b_at : b_at + w.b.numel()]
        copy_serial(b.view(rank, fan_out).t() if transposed else b.view(fan_out, rank), w.b)
        at = b_at + w.b.numel()
        m = -1
        if w.magnitude is not None:
            m, m_at = m_at, m_at + fan_out
            copy_serial(magnitudes[m:m_at], w.magnitude)
        modules.append(PackedModule(layer, module, rank, fan_in, fan_out, a_at, b_at, w.scale, m))
    return PackedPart(part.source, part.digest, dtype, transposed, buffer, tuple(modules), tail)


def unpack(packed: PackedPart) -> LoadedAdapter:
    """The adapter `packed` holds, its tensors views of the buffer (no copy)."""
    size = torch.empty(0, dtype=packed.dtype).element_size()
    numel = sum(m.rank * (m.fan_in + m.fan_out) for m in packed.modules)
    flat = torch.from_numpy(packed.buffer[: numel * size]).view(packed.dtype)
    magnitudes = torch.from_numpy(packed.buffer[packed.tail :]).view(torch.float32)
    modules = {}
    for m in packed.modules:
        a = flat[m.a_at : m.a_at + m.rank * m.fan_in].view(m.rank, m.fan_in)
        b = flat[m.b_at : m.b_at + m.rank * m.fan_out]
        b = b.view(m.rank, m.fan_out).t() if packed.transposed else b.view(m.fan_out, m.rank)
        magnitude = None if m.m_at < 0 else magnitudes[m.m_at : m.m_at + m.fan_out]
        modules[(m.layer, m.module)] = LoRAWeights(a=a, b=b, scale=m.scale, magnitude=magnitude)
    return LoadedAdapter(packed.source, modules, packed.digest)


def wire(parts: Sequence[PackedPart]) -> tuple[PackedPart, list[np.ndarray]]:
    """`parts` (one per worker) as rank 0 ships them: their one layout (an empty buffer) and
    each one's buffer; ValueError if their layouts differ (they cannot: the splits are equal)."""
    layout = dataclasses.replace(parts[0], buffer=np.empty(0, dtype=np.uint8))
    for part in parts:
        if part.modules != layout.modules or part.nbytes != parts[0].nbytes:
            raise ValueError(f"adapter {part.digest}: the ranks' parts differ in layout")
    return layout, [part.buffer for part in parts]


def with_buffer(layout: PackedPart, buffer: np.ndarray) -> PackedPart:
    """A worker's part: the layout the step message carried with the bytes it received."""
    return dataclasses.replace(layout, buffer=buffer)


def peer_parts(
    adapter: LoadedAdapter, shard: TPShard, heads: Heads, dtype: torch.dtype, transposed: bool
) -> tuple[PackedPart, ...]:
    """`adapter`'s part on every rank of the group but `shard.rank`, in rank order, packed in
    the pools' `dtype` and B layout: what rank 0 keeps with its host copy and ships each
    worker when the adapter takes a slot."""
    return tuple(
        pack(shard_adapter(adapter, TPShard(rank, shard.size), heads), dtype, transposed)
        for rank in range(shard.size)
        if rank != shard.rank
    )
