"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, and prefix caching.

A sequence's `block_table` maps its token positions to physical blocks (`block_size` tokens
each). Prefix caching: once a block is full and its K/V computed, it is registered under
`hash(previous block's hash, salt, the block's token ids)`. The salt is the sequence's adapter
identity (tenant and weights digest), or for the base model a fixed salt and the tenant, so two
adapters, two tenants, or two versions of one adapter never share K/V even for identical tokens
(nor can one tenant learn from its latency what another recently sent). Requests for prompt
log-probabilities neither take nor register cached blocks. A new sequence takes
the longest chain of registered blocks matching its tokens (hash, salt and token ids all
compared, so a hash collision cannot hand out wrong K/V), always leaving at least its last token
to compute so the step that follows has logits to sample from.

Free blocks come in two kinds: never-registered ones (taken first, lowest id first) and
registered ones whose last user let go. The latter stay findable and are evicted least recently
freed first, only when a block is needed and no other is free. Hashes are blake2b over bytes,
stable across processes (Python's `hash()` is salted per process).

Shared with adapters (`lora/arena.py`): `reserve(n)` takes a run of n consecutive blocks that
no sequence uses, highest ids first (sequences take the lowest, so the two ends rarely meet),
for an adapter's weights; `release` gives them back. Reserved blocks are neither free nor used
by a sequence. When a sequence needs more blocks than are free, `reclaim` (set by the engine)
is asked to release idle adapters' runs before the scheduler preempts anyone.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from loraplane.dataplane.sequence import Sequence, blocks_for


def block_hash(parent: bytes | None, salt: bytes, token_ids: list[int]) -> bytes:
    """The prefix-cache key of a full block given its parent's key (None for the first)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"\x00" * 16)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


@dataclass(slots=True)
class Block:
    """One physical KV block: its users, and its registration (if full and registered)."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    parent: bytes | None = None
    salt: bytes = b""
    token_ids: tuple[int, ...] = field(default=())


class FreeBlocks:
    """Unregistered free block ids, lowest first; a given id can be taken out in place."""

    def __init__(self, num_blocks: int) -> None:
        self._heap = list(range(num_blocks))  # may hold ids taken since: skipped when popped
        self._queued = bytearray(b"\x01" * num_blocks)  # id has an entry in the heap
        self._free = bytearray(b"\x01" * num_blocks)  # id is free now
        self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, int) and bool(self._free[block_id])

    def push(self, block_id: int) -> None:
        if self._free[block_id]:
            raise RuntimeError(f"block {block_id} is freed twice")
        self._free[block_id] = 1
        self._count += 1
        if not self._queued[block_id]:
            self._queued[block_id] = 1
            heapq.heappush(self._heap, block_id)

    def pop(self) -> int:
        """The lowest free id (IndexError when none)."""
        while True:
            block_id = heapq.heappop(self._heap)
            self._queued[block_id] = 0
            if self._free[block_id]:
                self._free[block_id] = 0
                self._count -= 1
                return block_id

    def take(self, block_id: int) -> None:
        """Take a given free id out (its heap entry is skipped later)."""
        if not self._free[block_id]:
            raise RuntimeError(f"block {block_id} is not free")
        self._free[block_id] = 0
        self._count -= 1


class BlockManager:
    """Allocates KV blocks to sequences, shares cached prefix blocks, evicts LRU cached blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free = FreeBlocks(num_blocks)  # unregistered, ref_count 0, not reserved
        self._reserved = bytearray(num_blocks)  # 1: part of an adapter's run (lora/arena.py)
        self._held = bytearray(num_blocks)  # 1: reserved, or used by a sequence (ref_count > 0)
        self.num_reserved = 0
        # releases idle adapters' blocks when sequences need more than are free (engine)
        self.reclaim: Callable[[int], None] | None = None
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, ref_count 0; LRU
        self._cached: dict[bytes, int] = {}  # hash -> block id
        self.cache_hit_tokens = 0  # cumulative, for metrics
        self.evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user (including cached ones that may be evicted)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by some sequence (vllm:kv_cache_usage_perc)."""
        return 1.0 - (self.num_free_blocks + self.num_reserved) / self.num_blocks

    def held_map(self) -> bytearray:
        """A copy of the map `reserve` searches: per block 1 when reserved or used by a
        sequence, 0 when nobody holds it (the adapter arena plans its reclaims on it)."""
        return bytearray(self._held)

    def reserve(self, n: int) -> int | None:
        """Take a run of `n` consecutive blocks that no sequence uses (free, or cached and
        evicted for it), the highest such run; return its first id, or None when no run is
        long enough now."""
        if n < 1 or n > self.num_blocks:
            return None
        first = self._held.rfind(bytes(n))  # the highest run of n blocks nobody holds
        if first < 0:
            return None
        for block_id in range(first, first + n):
            self._take_for_reserve(block_id)
        self.num_reserved += n
        return first

    def _take_for_reserve(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block_id in self._evictable:  # a cached prefix block nobody uses: forget it
            del self._evictable[block_id]
            if block.hash is not None and self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
            block.hash, block.parent, block.salt, block.token_ids = None, None, b"", ()
            self.evictions += 1
        else:
            self._free.take(block_id)
        self._reserved[block_id] = self._held[block_id] = 1

    def release(self, first: int, n: int) -> None:
        """Give back a run taken by `reserve`."""
        for block_id in range(first, first + n):
            if not self._reserved[block_id]:
                raise RuntimeError(f"block {block_id} is not reserved")
            self._reserved[block_id] = self._held[block_id] = 0
            self._free.push(block_id)
        self.num_reserved -= n

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence could ever hold."""
        return self.num_blocks * self.block_size

    def _full_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of every full block of seq's tokens, extending seq.block_hashes as it grows."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), len(seq.token_ids) // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(block_hash(parent, seq.cache_salt, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _prefix_hit(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence that has none allocated."""
        if not self.enable_prefix_caching or seq.block_table or not seq.uses_prefix_cache:
            return []
        bs = self.block_size
        usable = (len(seq.token_ids) - 1) // bs  # the last token must be computed: keep it out
        hit: list[int] = []
        parent: bytes | None = None
        salt = seq.cache_salt
        for i, h in enumerate(self._full_block_hashes(seq)[:usable]):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if block.parent != parent or block.salt != salt or block.token_ids != tokens:
                break  # a hash collision: never hand out another prefix's K/V
            hit.append(block_id)
            parent = h
        return hit

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens that `allocate` would take from the prefix cache for this sequence now."""
        return len(self._prefix_hit(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would find enough free blocks.

        `num_new_tokens` counts tokens to compute beyond what is computed (for a sequence with
        no blocks yet: beyond its cached prefix, see `num_cached_prefix_tokens`).
        """
        if self._fits(seq, num_new_tokens):  # most decode steps: the last block has room
            return True
        hit = self._prefix_hit(seq)
        computed = len(hit) * self.block_size if hit else seq.num_computed_tokens
        have = len(hit) if hit else len(seq.block_table)
        need = blocks_for(computed + num_new_tokens, self.block_size) - have
        # cached blocks that nobody uses count as free now, but stop being free once shared
        revived = sum(1 for b in hit if self.blocks[b].ref_count == 0)
        short = need + revived - self.num_free_blocks
        if short > 0 and self.reclaim is not None and self.num_reserved:
            self.reclaim(short)  # idle adapters give their blocks back before anyone waits
            short = need + revived - self.num_free_blocks
        return short <= 0

    def _fits(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a sequence with blocks holds `num_new_tokens` more without a new block (a
        decode step's usual case, checked for every row of every step: kept to one sum)."""
        table = seq.block_table
        return bool(table) and (
            seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size
        )

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table to hold its computed tokens plus `num_new_tokens`.

        On a sequence's first allocation, shares the cached prefix blocks and sets
        seq.num_cached_tokens and seq.num_computed_tokens to the tokens they hold.
        Raises RuntimeError if there are not enough free blocks (check `can_allocate`).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if self._fits(seq, num_new_tokens):
            return
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError(f"not enough free KV blocks for request {seq.request_id!r}")
        if not seq.block_table:
            if seq.num_computed_tokens:
                raise ValueError("a sequence without blocks cannot have computed tokens")
            hit = self._prefix_hit(seq)
            for block_id in hit:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._evictable[block_id]
                    self._held[block_id] = 1
                block.ref_count += 1
            seq.block_table = list(hit)
            seq.num_cached_tokens = seq.num_computed_tokens = len(hit) * self.block_size
            seq.num_registered_blocks = len(hit)
            self.cache_hit_tokens += seq.num_cached_tokens
        target = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < target:
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.pop()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None and self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
            self.evictions += 1
        block = self.blocks[block_id]
        self._held[block_id] = 1
        block.ref_count, block.hash, block.parent, block.salt, block.token_ids = (
            1,
            None,
            None,
            b"",
            (),
        )
        return block_id

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the sequence's full, computed blocks findable by later sequences.

        Call after each step, once seq.num_computed_tokens counts the step's tokens.
        """
        if not self.enable_prefix_caching or not seq.uses_prefix_cache:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        hashes = self._full_block_hashes(seq)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, full):
            block = self.blocks[seq.block_table[i]]
            # a twin computed by another sequence at the same time stays registered; this copy
            # remains private and goes back to the plain free list when released
            if block.hash is None and hashes[i] not in self._cached:
                block.hash = hashes[i]
                block.parent = hashes[i - 1] if i else None
                block.salt = seq.cache_salt
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._cached[hashes[i]] = block.block_id
        seq.num_registered_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; it keeps no computed tokens afterwards."""
        # release the tail first so that, among equally old blocks, a prefix outlives its tail
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._held[block_id] = 0
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.push(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
