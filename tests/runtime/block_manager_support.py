"""Shared by the BlockManager tests: a tiny pool geometry, sequences, and invariant checks."""

from __future__ import annotations

import itertools

from cleave.kv_store.block_hash import KVFingerprint
from cleave.runtime.engine.block_manager import BlockManager
from cleave.runtime.engine.sequence import SamplingParams, Sequence

BS = 4
ROOT = KVFingerprint("tiny", "digest", "float32", 2, 2, 8, block_size=BS).root_hash()
_ids = itertools.count()


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(f"r{next(_ids)}", list(tokens), len(tokens), SamplingParams())


def prompt(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def computed(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """Pretend the forward computed the first ``n`` (default: all) tokens' KV."""
    seq.num_computed_tokens = seq.num_tokens if n is None else n
    bm.mark_computed(seq)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            refs[b] += 1
    assert bm.ref_counts == refs
    assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if refs[b] == 0}
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h
    for b, bh in enumerate(bm.block_hash):
        if bh is not None:
            assert bm.hash_to_block[bh] == b
