"""BlockManager: paged block allocation, ref counts, freeing and growth."""

from __future__ import annotations

import pytest
from block_manager_support import BS, ROOT, check_invariants, computed, make_seq, prompt

from cleave.runtime.engine.block_manager import BlockManager


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, BS, ROOT)


def test_allocation_counts_and_usage_ratio() -> None:
    bm = BlockManager(8, BS, ROOT)
    assert bm.usage_ratio() == 0.0
    assert bm.blocks_for(0) == 0
    assert bm.blocks_for(1) == 1
    assert bm.blocks_for(4) == 1
    assert bm.blocks_for(5) == 2
    a = make_seq(prompt(10))
    assert bm.allocate(a)
    assert len(a.block_table) == 3
    assert len(set(a.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage_ratio() == pytest.approx(3 / 8)
    assert a.num_computed_tokens == 0
    assert a.num_cached_tokens == 0
    b = make_seq(prompt(4, base=5000))
    assert bm.allocate(b)
    assert len(b.block_table) == 1
    assert not set(a.block_table) & set(b.block_table)
    assert bm.usage_ratio() == pytest.approx(4 / 8)
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.usage_ratio() == 0.0
    assert a.block_table == [] and b.block_table == []
    check_invariants(bm, [])


def test_ref_counts_with_shared_prefix() -> None:
    bm = BlockManager(16, BS, ROOT)
    a = make_seq(prompt(9))
    assert bm.allocate(a)
    computed(bm, a)
    b = make_seq([*prompt(8), 7, 7, 7])
    assert bm.allocate(b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [bm.ref_counts[x] for x in shared] == [2, 2]
    assert bm.num_free_blocks == 16 - 3 - 1
    bm.free(a)
    assert [bm.ref_counts[x] for x in shared] == [1, 1]
    assert not set(shared) & set(bm.free_blocks)
    check_invariants(bm, [b])
    bm.free(b)
    assert set(shared) <= set(bm.free_blocks)
    assert bm.num_free_blocks == 16
    check_invariants(bm, [])


def test_double_free_is_caught() -> None:
    bm = BlockManager(4, BS, ROOT)
    a = make_seq(prompt(5))
    assert bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


def test_allocate_fails_without_side_effects() -> None:
    bm = BlockManager(4, BS, ROOT)
    a = make_seq(prompt(12, base=1))
    assert bm.allocate(a)
    b = make_seq(prompt(6, base=50))
    before = (list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block))
    assert bm.allocate(b) is False
    assert b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert (list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block)) == before
    check_invariants(bm, [a])


def test_allocate_counts_cached_free_hits_against_the_pool() -> None:
    bm = BlockManager(4, BS, ROOT)
    p = make_seq(prompt(9))
    assert bm.allocate(p)
    computed(bm, p)
    p0, p1, _ = p.block_table
    bm.free(p)
    x = make_seq(prompt(8, base=9000))  # takes the never-used block and p's tail
    assert bm.allocate(x)
    assert set(bm.free_blocks) == {p0, p1}
    # q hits p0 and p1 (both sitting free) but needs one more fresh block: 3 > 2 free.
    q = make_seq(prompt(9))
    before = (list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block),
              list(bm.block_hash))
    assert bm.allocate(q) is False
    after = (list(bm.ref_counts), list(bm.free_blocks), dict(bm.hash_to_block),
             list(bm.block_hash))
    assert after == before
    assert q.block_table == [] and q.num_cached_tokens == 0
    # With an 8-token prompt only p0 is a hit (last token recomputed): 1 hit + 1 fresh fits.
    r = make_seq(prompt(8))
    assert bm.allocate(r)
    assert r.block_table[0] == p0
    assert r.num_cached_tokens == 4
    check_invariants(bm, [x, r])


def test_allocate_with_shared_live_hits_needs_only_fresh_blocks() -> None:
    bm = BlockManager(4, BS, ROOT)
    a = make_seq(prompt(9))
    assert bm.allocate(a)  # 3 blocks in use, 1 free
    computed(bm, a)
    b = make_seq(prompt(9))  # 2 live hits + 1 fresh = fits in the single free block
    assert bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])


def test_allocate_refuses_sequence_holding_blocks() -> None:
    bm = BlockManager(4, BS, ROOT)
    a = make_seq(prompt(3))
    assert bm.allocate(a)
    with pytest.raises(AssertionError):
        bm.allocate(a)


def test_grow_and_can_grow() -> None:
    bm = BlockManager(3, BS, ROOT)
    a = make_seq(prompt(4))
    assert bm.allocate(a)
    assert len(a.block_table) == 1
    assert bm.can_grow(a, 4)
    bm.grow(a, 4)
    assert len(a.block_table) == 1  # no-op within the same block
    a.token_ids.append(1)
    assert bm.can_grow(a, 5)
    bm.grow(a, 5)
    assert len(a.block_table) == 2
    assert bm.num_free_blocks == 1
    assert bm.can_grow(a, 12)
    assert not bm.can_grow(a, 13)
    bm.grow(a, 12)
    assert len(a.block_table) == 3
    assert len(set(a.block_table)) == 3
    assert bm.num_free_blocks == 0
    assert bm.usage_ratio() == 1.0
    assert not bm.can_grow(a, 13)
    assert bm.can_grow(a, 12)
    check_invariants(bm, [a])


def test_grow_reuses_cached_free_block_and_drops_its_hash() -> None:
    bm = BlockManager(2, BS, ROOT)
    a = make_seq(prompt(4))
    assert bm.allocate(a)
    computed(bm, a)
    h = a.block_hashes[0]
    bm.free(a)
    b = make_seq(prompt(3, base=55))
    assert bm.allocate(b)  # takes the never-used block
    bm.grow(b, 5)  # must evict a's cached block
    assert h not in bm.hash_to_block
    assert all(x is None for x in bm.block_hash)
    check_invariants(bm, [b])
