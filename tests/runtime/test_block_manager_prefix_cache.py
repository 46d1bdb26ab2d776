"""BlockManager: prefix caching keyed by chained block hashes, and LRU eviction of cached blocks."""

from __future__ import annotations

import pytest
from block_manager_support import BS, ROOT, check_invariants, computed, make_seq, prompt

from cleave.kv_store.block_hash import KVFingerprint, chain_hashes
from cleave.runtime.engine.block_manager import BlockManager


def test_block_hashes_are_the_shared_chain() -> None:
    # One definition of block identity: the engine's hashes equal the store's chain_hashes.
    bm = BlockManager(8, BS, ROOT)
    a = make_seq(prompt(14))
    assert bm.allocate(a)
    computed(bm, a)
    assert a.block_hashes == chain_hashes(ROOT, a.token_ids, BS)
    assert set(bm.hash_to_block) == set(chain_hashes(ROOT, a.token_ids, BS))


def test_no_prefix_hit_before_mark_computed() -> None:
    bm = BlockManager(16, BS, ROOT)
    a = make_seq(prompt(13))
    assert bm.allocate(a)
    # a's KV is still being written: nothing is published, so b must not reuse it.
    b = make_seq(prompt(13))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert b.num_computed_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    assert bm.hash_to_block == {}
    check_invariants(bm, [a, b])


def test_prefix_hit_after_mark_computed() -> None:
    bm = BlockManager(16, BS, ROOT)
    a = make_seq(prompt(13))  # 3 full blocks + 1 token
    assert bm.allocate(a)
    computed(bm, a)
    b = make_seq(prompt(13))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 12
    assert b.num_computed_tokens == 12
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 2, 1]
    check_invariants(bm, [a, b])


def test_partially_computed_publishes_only_full_computed_blocks() -> None:
    bm = BlockManager(16, BS, ROOT)
    a = make_seq(prompt(13))
    assert bm.allocate(a)
    computed(bm, a, 7)  # block 0 complete, block 1 half written
    assert len(bm.hash_to_block) == 1
    assert bm.block_hash[a.block_table[0]] is not None
    assert bm.block_hash[a.block_table[1]] is None
    b = make_seq(prompt(13))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    # a finishes computing: its block 1 is now published and a third prompt hits it.
    computed(bm, a)
    c = make_seq(prompt(13))
    assert bm.allocate(c)
    assert c.block_table[:3] == a.block_table[:3]
    check_invariants(bm, [a, b, c])


def test_hits_stop_at_first_divergent_block() -> None:
    bm = BlockManager(16, BS, ROOT)
    a = make_seq(prompt(13))
    assert bm.allocate(a)
    computed(bm, a)
    tokens = prompt(13)
    tokens[5] = 1  # differs in block 1: blocks 1 and 2 miss even though block 2 matches
    b = make_seq(tokens)
    assert bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0]
    assert not set(b.block_table[1:]) & set(a.block_table)


def test_different_root_never_hits() -> None:
    bm = BlockManager(16, BS, ROOT)
    a = make_seq(prompt(13))
    assert bm.allocate(a)
    computed(bm, a)
    other_root = KVFingerprint("tiny", "digest", "float32", 2, 2, 8, BS, salt="x").root_hash()
    bm.root_hash = other_root
    b = make_seq(prompt(13))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_freed_blocks_keep_their_hashes() -> None:
    bm = BlockManager(8, BS, ROOT)
    a = make_seq(prompt(13))
    assert bm.allocate(a)
    computed(bm, a)
    head = a.block_table[:3]
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert bm.usage_ratio() == 0.0
    b = make_seq(prompt(13))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 12
    assert b.block_table[:3] == head
    assert not set(head) & set(bm.free_blocks)
    assert [bm.ref_counts[x] for x in head] == [1, 1, 1]
    assert bm.num_free_blocks == 8 - 4
    check_invariants(bm, [b])


def test_lru_evicts_least_recently_freed_first_and_tails_before_heads() -> None:
    bm = BlockManager(6, BS, ROOT)
    a = make_seq(prompt(8, base=100))
    b = make_seq(prompt(8, base=200))
    assert bm.allocate(a) and bm.allocate(b)
    computed(bm, a)
    computed(bm, b)
    assert bm.num_free_blocks == 2
    never_used = list(bm.free_blocks)
    bm.free(a)
    bm.free(b)
    # Never-used blocks go first, then a's (freed earlier) tail before head, then b's.
    expected = [*never_used, bm.hash_to_block[a.block_hashes[1]],
                bm.hash_to_block[a.block_hashes[0]], bm.hash_to_block[b.block_hashes[1]],
                bm.hash_to_block[b.block_hashes[0]]]
    assert list(bm.free_blocks) == expected
    c = make_seq(prompt(16, base=300))  # 4 blocks: never-used 2, then a's tail and head
    assert bm.allocate(c)
    assert c.block_table == expected[:4]
    # a's mappings are gone; b's survive and still hit.
    assert a.block_hashes[0] not in bm.hash_to_block
    assert a.block_hashes[1] not in bm.hash_to_block
    d = make_seq([*prompt(8, base=200), 1])
    assert bm.allocate(d) is False  # needs 3 blocks, only b's 2 cached ones are free
    e = make_seq(prompt(5, base=200))
    assert bm.allocate(e)
    assert e.num_cached_tokens == 4
    assert e.block_table[0] == expected[5]
    check_invariants(bm, [c, e])


def test_eviction_drops_stale_hash_mapping() -> None:
    bm = BlockManager(4, BS, ROOT)
    a = make_seq(prompt(9))  # 3 blocks, blocks 0 and 1 published once computed
    assert bm.allocate(a)
    computed(bm, a)
    a0, a1, _a2 = a.block_table
    h0, h1 = a.block_hashes[:2]
    bm.free(a)
    # Free order: the never-used block, then a2, a1, a0. An unrelated 3-block prompt
    # takes the never-used block, a2 and a1, evicting a1's cached content.
    x = make_seq(prompt(12, base=7000))
    assert bm.allocate(x)
    assert a1 in x.block_table and a0 not in x.block_table
    assert h1 not in bm.hash_to_block
    assert bm.block_hash[a1] is None
    assert bm.hash_to_block[h0] == a0
    check_invariants(bm, [x])
    # Once x is computed, a1 carries x's hash, not a's.
    computed(bm, x)
    assert bm.block_hash[a1] in x.block_hashes
    bm.free(x)
    b = make_seq(prompt(9))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 4  # only block 0 survived
    assert b.block_table[0] == a0
    assert b.block_table[1] != a1 or bm.block_hash[a1] is None
    check_invariants(bm, [b])


@pytest.mark.parametrize(
    "n,expected_hit_blocks",
    [(1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3), (16, 3)],
)
def test_last_token_is_always_recomputed(n: int, expected_hit_blocks: int) -> None:
    bm = BlockManager(16, BS, ROOT)
    a = make_seq(prompt(16))
    assert bm.allocate(a)
    computed(bm, a)  # all 4 blocks of the 16-token prompt published
    assert len(bm.hash_to_block) == 4
    b = make_seq(prompt(n))
    assert bm.allocate(b)
    assert expected_hit_blocks == (n - 1) // BS
    assert b.num_cached_tokens == expected_hit_blocks * BS
    assert b.num_computed_tokens < b.num_tokens
    assert b.block_table[:expected_hit_blocks] == a.block_table[:expected_hit_blocks]
    # The block holding the last token is never a shared one.
    assert bm.ref_counts[b.block_table[(n - 1) // BS]] == 1
    assert len(b.block_table) == bm.blocks_for(n)


def test_decode_publishes_block_when_it_fills() -> None:
    bm = BlockManager(8, BS, ROOT)
    a = make_seq(prompt(3))
    assert bm.allocate(a)
    computed(bm, a)
    assert bm.hash_to_block == {}
    a.token_ids.append(42)  # sampled token; the block fills once its KV is computed
    bm.grow(a, 4)
    computed(bm, a, 3)
    assert bm.hash_to_block == {}
    computed(bm, a, 4)
    assert list(bm.hash_to_block) == chain_hashes(ROOT, a.token_ids, BS)


def test_duplicate_content_keeps_first_cached_block() -> None:
    bm = BlockManager(8, BS, ROOT)
    a = make_seq(prompt(9))
    b = make_seq(prompt(9))
    assert bm.allocate(a) and bm.allocate(b)  # both miss: nothing published yet
    computed(bm, a)
    computed(bm, b)
    assert bm.hash_to_block[a.block_hashes[0]] == a.block_table[0]
    assert bm.block_hash[b.block_table[0]] is None
    check_invariants(bm, [a, b])
    a_head = a.block_table[:2]
    bm.free(a)
    bm.free(b)
    c = make_seq(prompt(9))
    assert bm.allocate(c)
    assert c.block_table[:2] == a_head


def test_reset_prefix_cache_forgets_free_blocks_but_not_live_ones() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, root_hash=ROOT)
    live, done = make_seq(prompt(9)), make_seq(prompt(9, base=2000))
    for s in (live, done):
        assert bm.allocate(s)
        computed(bm, s, 8)
    bm.free(done)
    bm.reset_prefix_cache()
    again = make_seq(prompt(9, base=2000))
    assert bm.allocate(again)
    assert again.num_cached_tokens == 0  # the freed chain is forgotten
    shared = make_seq(prompt(9))
    assert bm.allocate(shared)
    assert shared.num_cached_tokens == 8  # the live chain still serves hits
    check_invariants(bm, [live, again, shared])
