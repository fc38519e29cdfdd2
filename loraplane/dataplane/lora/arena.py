"""Adapter weights inside the KV cache: one device budget for KV blocks and adapter slots.

The KV cache is one tensor [2, layers, blocks, block_size, kv_heads, head_dim]. For a run of n
consecutive blocks, layer l owns two contiguous regions of n * block_size * kv_heads * head_dim
elements: its K part `cache[0, l, b:b+n]` and its V part `cache[1, l, b:b+n]`. An adapter placed
in the arena takes such a run (`BlockManager.reserve`) and its layer-l A and B tensors become
views of layer l's two regions (packed first-fit, largest first), filled by a copy. Nothing
else changes: the LoRA layers read the same per-slot tensors, the kernels the same pointers.

So memory is shared both ways: blocks no adapter holds are KV cache, and idle resident adapters
are a cache that sequences take back (`LoRAManager.reclaim_blocks`) before anyone is
preempted, while the adapters of running requests are held within `--lora-memory`. An adapter
takes whole blocks, in every layer: the rounding is what it costs (`blocks_for`).

Alignment: every view starts on `ALIGN_BYTES` (16). The Triton SGMV kernels take their
pointer hints from the gcd of the slots' addresses (`SlotWeights.ptr_align`), and a CUDA
graph's slot tables promise 16 bytes outright (`cuda_graphs.PTR_ALIGN`; a slot breaking that
replays eagerly): so each tensor's offset in its region is rounded up to 16 bytes (free for
real models, whose r * features elements are already a multiple of 8), and a region that does
not itself start on 16 bytes (a cache whose blocks are not a multiple of 16 bytes, or whose
base is not aligned) refuses the placement with `ArenaAlignmentError`, naming the adapter, the
tensor and the offset, before any view is handed out. Ranks stay the adapters' own: one that
is not a multiple of 8 keeps its steps out of the graphs (`DecodeGraphs._unfit`), never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplane.dataplane.arena_layout import ALIGN_BYTES, blocks_needed, pack
from loraplane.dataplane.block_manager import BlockManager
from loraplane.dataplane.lora.weights import LoadedAdapter

Key = tuple[int, str]  # (layer, module)


class ArenaAlignmentError(ValueError):
    """An adapter's view in the KV cache would not start on ALIGN_BYTES (see the module
    docstring): the placement is refused and its blocks given back."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one adapter lives: blocks [first, first + num_blocks) and its tensor views."""

    first: int
    num_blocks: int
    views: dict[Key, tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B)


class KVArena:
    """Runs of KV blocks lent to adapters. A tensor-parallel worker's arena has no block
    manager (`blocks` None): rank 0's reserves each run, and the worker places its part of the
    adapter at the same first block (`place(adapter, at=first)`), its layout the same (every
    rank's part and KV block have the same shapes)."""

    def __init__(self, kv_cache: torch.Tensor, blocks: BlockManager | None) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[0] != 2:
            raise ValueError(f"expected a [2, L, N, bs, kv, d] cache, got {tuple(kv_cache.shape)}")
        if blocks is not None and kv_cache.shape[2] != blocks.num_blocks:
            raise ValueError(
                f"the cache has {kv_cache.shape[2]} blocks, the block manager {blocks.num_blocks}"
            )
        self.cache = kv_cache
        self.blocks = blocks
        self.num_layers = kv_cache.shape[1]
        self.chunk = int(kv_cache[0, 0, 0].numel())  # elements of one block in one region
        self.block_bytes = 2 * self.num_layers * self.chunk * kv_cache.element_size()
        # elements per ALIGN_BYTES: each tensor's offset in its region is a multiple of this
        self.align = max(1, ALIGN_BYTES // kv_cache.element_size())

    def blocks_for(self, adapter: LoadedAdapter) -> int:
        """Blocks the adapter takes: the fewest n that pack every layer's tensors into its two
        regions of n blocks each."""
        return blocks_needed(self._by_layer(adapter).values(), self.chunk, self.align)

    def place(self, adapter: LoadedAdapter, at: int | None = None) -> Placement | None:
        """Reserve a run and copy the adapter into it; None when no run is free now. A worker's
        arena copies it into the run rank 0 reserved from block `at`."""
        n = self.blocks_for(adapter)
        if self.blocks is None:
            if at is None or not 0 <= at <= self.cache.shape[2] - n:
                raise ValueError(f"a worker's arena places at rank 0's run, not at {at}")
            first: int | None = at
        else:
            first = self.blocks.reserve(n)
        if first is None:
            return None
        regions = {
            layer: (
                self.cache[0, layer, first : first + n].view(-1),
                self.cache[1, layer, first : first + n].view(-1),
            )
            for layer in range(self.num_layers)
        }
        # where each tensor goes, all checked before anything is copied or handed out
        plan: list[tuple[Key, str, torch.Tensor, torch.Tensor]] = []
        for layer, items in self._items_by_layer(adapter).items():
            offsets = self._pack([t.numel() for _, _, t in items], n)
            if offsets is None:  # pragma: no cover - blocks_for guarantees a packing
                self.free(Placement(first, n, {}))
                raise RuntimeError(f"layer {layer} does not pack into {n} blocks")
            for (key, role, tensor), (region, offset) in zip(items, offsets, strict=True):
                view = regions[layer][region][offset : offset + tensor.numel()].view(tensor.shape)
                if view.data_ptr() % ALIGN_BYTES:  # offsets are aligned: the region is not
                    self.free(Placement(first, n, {}))
                    why = self._misaligned(adapter, key, role, region, offset, first, n, view)
                    raise ArenaAlignmentError(why)
                plan.append((key, role, tensor, view))
        placed: dict[Key, dict[str, torch.Tensor]] = {}
        for key, role, tensor, view in plan:
            view.copy_(tensor, non_blocking=True)  # pinned host copy: no host stall
            placed.setdefault(key, {})[role] = view
        views = {key: (pair["a"], pair["b"]) for key, pair in placed.items()}
        return Placement(first, n, views)

    def _misaligned(
        self, adapter: LoadedAdapter, key: Key, role: str, region: int, offset: int,
        first: int, n: int, view: torch.Tensor,
    ) -> str:  # fmt: skip
        return (
            f"adapter {adapter.source!r}: layer {key[0]} {key[1]} {role.upper()} would sit at "
            f"element {offset} of the {'KV'[region]} region of blocks {first}..{first + n - 1}, "
            f"address {view.data_ptr():#x}, not on {ALIGN_BYTES} bytes (KV blocks of "
            f"{self.chunk} elements of {self.cache.element_size()} bytes per layer, the cache "
            f"at {self.cache.data_ptr():#x}): the Triton kernels need aligned views"
        )

    def free(self, placement: Placement) -> None:
        """Give the run back to the KV cache (rank 0's, which reserved it)."""
        if self.blocks is not None:
            self.blocks.release(placement.first, placement.num_blocks)

    def runs_to_free(self, n: int, runs: list[tuple[int, int]]) -> list[int] | None:
        """Which of `runs` (idle adapters' runs as (first block, blocks), in the order they
        may be given up) must be freed for `n` consecutive blocks that nothing holds: the
        indices of those that overlap the run found after freeing the fewest of the first
        ones, so an adapter the run does not touch stays; [] when a run is free now; None
        when there is none even with all of `runs` freed (under fragmentation, sequences'
        blocks split the cache): then freeing any of them would be for nothing."""
        # the block manager's map (1: reserved or used by a sequence), a copy to plan on;
        # `reserve` looks for the same thing in it (the highest run of n zeros)
        if self.blocks is None:  # pragma: no cover - rank 0 plans the reclaims
            raise RuntimeError("a worker's arena plans no reclaims")
        held = self.blocks.held_map()
        if n < 1 or n > len(held):
            return None
        empty = bytes(n)
        if held.rfind(empty) >= 0:
            return []
        # the common failure first, in one search: no run even with every one freed (the
        # scheduler asks again each step while a request waits for room)
        every = bytearray(held)
        for first, size in runs:
            every[first : first + size] = bytes(size)
        if every.rfind(empty) < 0:
            return None
        for k, (first, size) in enumerate(runs):
            held[first : first + size] = bytes(size)
            at = held.rfind(empty)
            if at >= 0:  # the run overlaps run k (there was none before): free what it overlaps
                return [i for i, (f, m) in enumerate(runs[: k + 1]) if f < at + n and at < f + m]
        return None

    @staticmethod
    def _items_by_layer(adapter: LoadedAdapter) -> dict[int, list[tuple[Key, str, torch.Tensor]]]:
        """Per layer, every tensor with its module and role ("a" or "b"), largest first."""
        out: dict[int, list[tuple[Key, str, torch.Tensor]]] = {}
        for (layer, module), w in adapter.modules.items():
            key = (layer, module)
            out.setdefault(layer, []).extend([(key, "a", w.a), (key, "b", w.b)])
        for items in out.values():
            items.sort(key=lambda item: -item[2].numel())
        return out

    def _by_layer(self, adapter: LoadedAdapter) -> dict[int, list[int]]:
        return {
            layer: [t.numel() for _, _, t in items]
            for layer, items in self._items_by_layer(adapter).items()
        }

    def _pack(self, sizes: list[int], n: int) -> list[tuple[int, int]] | None:
        """(region, offset) of each of `sizes` in n blocks (`arena_layout.pack`), or None."""
        return pack(sizes, n * self.chunk, self.align)
