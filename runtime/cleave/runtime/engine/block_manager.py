"""Paged KV block accounting with reference counts and prefix caching; torch-free.

Blocks are identified by the chained hash of ``cleave.kv_store.block_hash`` so the local prefix
cache and the shared store agree on identity. A block's hash is registered only once its KV has
been computed, so no sequence can ever attend over a block that is still being written. Freed
blocks keep their hash and sit in an LRU free list: they are reused by a later prefix hit until
the space is needed for something else.
"""

from __future__ import annotations

from collections import OrderedDict

from cleave.kv_store.block_hash import next_block_hash, salted_root
from cleave.runtime.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, root_hash: bytes) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.root_hash = root_hash
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Insertion order is eviction order: least recently freed first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix-cache lookups of admitted sequences, in tokens (vLLM's prefix_cache_queries
        # and _hits): plain ints the worker exports, so this module stays metrics-free.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage_ratio(self) -> float:
        """Share of blocks held by live sequences: the KV-cache (HBM) pressure signal."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extend_hashes(self, seq: Sequence, upto_tokens: int) -> None:
        """Make ``seq.block_hashes`` cover every full block within its first ``upto_tokens``."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), upto_tokens // bs):
            # A request's cache_salt salts its chain: it shares blocks with its own salt only.
            parent = seq.block_hashes[i - 1] if i else salted_root(self.root_hash,
                                                                   seq.params.cache_salt)
            seq.block_hashes.append(next_block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        # At least the last token is always recomputed (its logits are needed), and the
        # recomputed region starts on a block boundary so no shared block is ever written.
        self._extend_hashes(seq, seq.num_tokens)
        if seq.scores_prompt:
            return []  # prompt logprobs need every prompt position's logits (reads_cached_prefix)
        limit = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in seq.block_hashes[:limit]:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def reset_prefix_cache(self) -> None:
        """Forget every cached free block (benchmarks, tests); blocks in use are untouched."""
        for block, h in enumerate(self.block_hash):
            if h is not None and self.ref_counts[block] == 0:
                self.block_hash[block] = None
                del self.hash_to_block[h]

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.

        Returns False, changing nothing, when the pool cannot hold it now.
        """
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._prefix_hits(seq)
        hits_taken_from_free = sum(1 for b in hits if self.ref_counts[b] == 0)
        fresh = self.blocks_for(seq.num_tokens) - len(hits)
        if fresh + hits_taken_from_free > self.num_free_blocks:
            return False
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        seq.block_table = hits + [self._take_free_block() for _ in range(fresh)]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        # Counted on admission only: a sequence refused for room is looked up again later;
        # one that may not read the cache was not looked up (vLLM counts neither).
        if not seq.scores_prompt:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_cached_tokens
        return True

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Ensure ``seq`` holds blocks for its first ``num_tokens`` tokens (call can_grow first)."""
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_free_block())

    def mark_computed(self, seq: Sequence) -> None:
        """Publish the hashes of blocks whose KV is now fully computed, for prefix reuse."""
        full = seq.num_computed_tokens // self.block_size
        self._extend_hashes(seq, full * self.block_size)
        for i in range(full):
            block = seq.block_table[i]
            if self.block_hash[block] is not None:
                continue
            h = seq.block_hashes[i]
            if h in self.hash_to_block:
                continue  # same content already cached in another block; keep that one
            self.block_hash[block] = h
            self.hash_to_block[h] = block

    def free(self, seq: Sequence) -> None:
        # Tail blocks are freed first so they are evicted before the shared heads of chains.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        stale = self.block_hash[block]
        if stale is not None:
            if self.hash_to_block.get(stale) == block:
                del self.hash_to_block[stale]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block
