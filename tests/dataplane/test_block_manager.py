"""BlockManager: allocation, reference counts, salted prefix caching, LRU eviction."""

from __future__ import annotations

import pytest

from loraplane.dataplane import block_manager as bm_module
from loraplane.dataplane.block_manager import BlockManager, block_hash
from loraplane.dataplane.sequence import BASE_SALT, LoRARef, Sequence

BS = 4


def seq_of(rid: str, tokens: list[int], lora: LoRARef | None = None) -> Sequence:
    return Sequence(rid, tokens, lora=lora)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and 'run' every uncomputed token, then register full blocks (as a step would)."""
    bm.allocate(seq, seq.num_tokens - bm.num_cached_prefix_tokens(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)


def test_allocate_grows_the_block_table_to_cover_computed_plus_new_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = seq_of("a", list(range(10)))
    bm.allocate(seq, 6)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 6
    bm.allocate(seq, 4)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)


def test_free_returns_blocks_and_resets_progress() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = seq_of("a", list(range(7)))
    bm.allocate(seq, 7)
    seq.num_computed_tokens = 7
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 4
    assert bm.usage == 0.0


def test_usage_is_the_fraction_of_blocks_in_use() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate(seq_of("a", list(range(5))), 5)
    assert bm.usage == pytest.approx(0.5)


def test_can_allocate_is_false_and_allocate_raises_when_blocks_run_out() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = seq_of("a", list(range(12)))
    assert bm.can_allocate(seq, 8)
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(seq, 9)
    assert bm.num_free_blocks == 2  # nothing taken by the failed call


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "field"),
    [(0, 4, "num_blocks"), (4, 0, "block_size"), (True, 4, "num_blocks"), (4, 2.0, "block_size")],
)
def test_bad_sizes_are_rejected_naming_the_argument(
    num_blocks: object, block_size: object, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        BlockManager(num_blocks, block_size)  # type: ignore[arg-type]


def test_same_prefix_same_salt_shares_full_blocks_and_counts_references() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = seq_of("a", list(range(10)))
    compute_all(bm, first)
    second = seq_of("b", [*range(8), 99, 98, 97])
    assert bm.num_cached_prefix_tokens(second) == 8
    bm.allocate(second, second.num_tokens - 8)
    assert second.num_cached_tokens == second.num_computed_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [bm.blocks[b].ref_count for b in first.block_table[:2]] == [2, 2]
    bm.free(first)
    assert [bm.blocks[b].ref_count for b in second.block_table[:2]] == [1, 1]


def test_the_whole_prompt_is_never_cached_so_the_last_token_has_logits() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    compute_all(bm, seq_of("a", list(range(8))))
    again = seq_of("b", list(range(8)))  # two full blocks, both cached
    assert bm.num_cached_prefix_tokens(again) == 4  # the block holding the last token is redone
    bm.allocate(again, 4)
    assert again.num_computed_tokens == 4


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (LoRARef("sql", "acme", "d1"), LoRARef("sql", "other", "d1")),  # another tenant
        (LoRARef("sql", "acme", "d1"), LoRARef("sql", "acme", "d2")),  # a new version
        (None, LoRARef("sql", "acme", "d1")),  # base model vs an adapter
        (LoRARef("sql", "acme", "d1"), None),
    ],
)
def test_different_tenant_digest_or_base_never_share_blocks(
    first: LoRARef | None, second: LoRARef | None
) -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(range(13))
    compute_all(bm, seq_of("a", tokens, first))
    other = seq_of("b", tokens, second)
    assert bm.num_cached_prefix_tokens(other) == 0
    bm.allocate(other, other.num_tokens)
    assert other.num_cached_tokens == 0
    assert all(bm.blocks[b].ref_count == 1 for b in other.block_table)


def test_same_adapter_version_shares_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    ref = LoRARef("sql", "acme", "d1")
    compute_all(bm, seq_of("a", list(range(13)), ref))
    assert bm.num_cached_prefix_tokens(seq_of("b", list(range(13)), ref)) == 12


def test_only_full_and_computed_blocks_are_registered() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    seq = seq_of("a", list(range(10)))
    bm.allocate(seq, 10)
    seq.num_computed_tokens = 6  # one full block computed, the second half-way
    bm.register_full_blocks(seq)
    probe = seq_of("p", list(range(10)))
    assert bm.num_cached_prefix_tokens(probe) == 4
    seq.num_computed_tokens = 10
    bm.register_full_blocks(seq)
    assert bm.num_cached_prefix_tokens(probe) == 8


def test_freed_cached_blocks_stay_reusable_until_needed() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    first = seq_of("a", list(range(9)))
    compute_all(bm, first)
    bm.free(first)
    assert bm.num_free_blocks == 4  # cached blocks count as free
    again = seq_of("b", list(range(9)))
    assert bm.num_cached_prefix_tokens(again) == 8
    bm.allocate(again, 1)
    assert again.num_cached_tokens == 8
    assert bm.cache_hit_tokens == 8


def test_unregistered_free_blocks_are_used_before_cached_ones_are_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    cached = seq_of("a", list(range(8)))
    compute_all(bm, cached)  # blocks 0 and 1 registered
    bm.free(cached)
    other = seq_of("b", [50 + i for i in range(8)])
    bm.allocate(other, 8)  # takes the two never-registered blocks
    assert bm.evictions == 0
    assert bm.num_cached_prefix_tokens(seq_of("p", list(range(9)))) == 8


def test_under_pressure_the_least_recently_freed_cached_blocks_are_evicted_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = seq_of("old", [1] * 4 + [2])
    new = seq_of("new", [3] * 4 + [4])
    compute_all(bm, old)
    compute_all(bm, new)
    bm.free(old)  # freed first: evicted first
    bm.free(new)
    hog = seq_of("hog", [9] * 13)  # needs all 4 blocks: 2 plain free, then 2 evictions
    bm.allocate(hog, 9)  # 3 blocks: the 2 plain ones and the LRU cached one
    assert bm.evictions == 1
    assert bm.num_cached_prefix_tokens(seq_of("o", [1] * 4 + [2])) == 0
    assert bm.num_cached_prefix_tokens(seq_of("n", [3] * 4 + [4])) == 4


def test_a_referenced_cached_block_is_never_evicted() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    user = seq_of("a", list(range(5)))
    compute_all(bm, user)  # holds 2 blocks, one registered
    hog = seq_of("hog", [7] * 20)
    assert bm.can_allocate(hog, 4)
    assert not bm.can_allocate(hog, 5)
    bm.allocate(hog, 4)
    assert bm.blocks[user.block_table[0]].ref_count == 1
    assert bm.evictions == 0


def test_can_allocate_counts_a_revived_cached_block_as_taken() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    first = seq_of("a", list(range(5)))
    compute_all(bm, first)
    bm.free(first)  # block 0 cached and free, block 1 plain free
    again = seq_of("b", [*range(4), 8, 9, 10, 11, 12])  # hit: 1 block; 5 more tokens: 2 blocks
    assert bm.num_cached_prefix_tokens(again) == 4
    assert bm.can_allocate(again, 4)  # the hit block + 1 new block
    assert not bm.can_allocate(again, 5)  # the hit block + 2 new blocks > 2


def test_a_hash_collision_never_shares_another_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, salt, tokens: b"same" * 4)
    bm = BlockManager(num_blocks=8, block_size=BS)
    compute_all(bm, seq_of("a", list(range(9))))
    assert bm.num_cached_prefix_tokens(seq_of("b", [5, 6, 7, 8, 9])) == 0


def test_twin_blocks_computed_concurrently_stay_private_and_are_recycled() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = seq_of("a", list(range(5))), seq_of("b", list(range(5)))
    bm.allocate(a, 5)
    bm.allocate(b, 5)  # nothing registered yet: no hit, own blocks
    for seq in (a, b):
        seq.num_computed_tokens = 5
        bm.register_full_blocks(seq)
    twin = b.block_table[0]
    assert bm.blocks[a.block_table[0]].hash is not None
    assert bm.blocks[twin].hash is None  # the first registration wins
    bm.free(b)
    assert twin in bm._free  # back to the plain free list, not kept as a cache entry
    probe = seq_of("p", list(range(5)))
    bm.allocate(probe, 1)
    assert probe.block_table[0] == a.block_table[0]


def test_prefix_caching_off_never_shares() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    compute_all(bm, seq_of("a", list(range(9))))
    assert bm.num_cached_prefix_tokens(seq_of("b", list(range(9)))) == 0


def test_block_hash_is_stable_and_covers_parent_salt_and_tokens() -> None:
    h = block_hash(None, BASE_SALT, [1, 2, 3, 4])
    assert h == block_hash(None, BASE_SALT, [1, 2, 3, 4])
    assert len(h) == 16
    assert h != block_hash(h, BASE_SALT, [1, 2, 3, 4])
    assert h != block_hash(None, b"other", [1, 2, 3, 4])
    assert h != block_hash(None, BASE_SALT, [1, 2, 3, 5])
    # a known value: the hash is the same in every process (not Python's salted hash())
    assert h.hex() == "166af79a005a1dd36e3c78ec2fd7df0b"


def test_a_row_whose_last_block_has_room_is_checked_without_the_prefix_or_free_lists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every decode row of every step asks can_allocate and allocate: where the last block has
    room the answer is one sum (no prefix walk, no free count), and a full block still takes
    the long way and a new block."""
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    seq = seq_of("a", list(range(6)))
    compute_all(bm, seq)  # 6 tokens: blocks of 4 + 2, room for 2 more
    walks: list[int] = []
    real = bm._prefix_hit
    monkeypatch.setattr(bm, "_prefix_hit", lambda s: walks.append(1) or real(s))
    for _ in range(2):
        assert bm.can_allocate(seq, 1)
        bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
    assert walks == [] and len(seq.block_table) == 2
    assert bm.can_allocate(seq, 1) and walks == [1]  # the block is full: the long way
    bm.allocate(seq, 1)
    assert len(seq.block_table) == 3
