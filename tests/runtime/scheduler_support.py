"""The scheduler tests' harness: a fake model, the sequences it runs, and reference outputs.

A fake "model" drives the scheduler: after ``schedule()`` every chunk's tokens are written into a
fake KV pool (one token id per slot), every position the chunk attends over is checked to hold
the right token, and chunks that reach the end of their sequence get a sampled token that is a
deterministic function of the sequence so far.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from cleave.kv_store.block_hash import KVFingerprint
from cleave.runtime.engine.block_manager import BlockManager
from cleave.runtime.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from cleave.runtime.engine.sequence import SamplingParams, Sequence, SequenceStatus

BS = 4
ROOT = KVFingerprint("tiny", "digest", "float32", 2, 2, 8, block_size=BS).root_hash()
EOS = 2
_bases = itertools.count(1000, 1000)


def fake_token(seq: Sequence) -> int:
    """Deterministic next token from the history; never EOS (2) or the stop tokens used."""
    return 500 + (sum(seq.token_ids) * 31 + len(seq.token_ids)) % 97


def make_seq(rid: str, n: int, max_tokens: int = 4, *, tokens: list[int] | None = None,
             **kw: object) -> Sequence:
    params_kw = {k: kw.pop(k) for k in ("stop_token_ids", "ignore_eos") if k in kw}
    params = SamplingParams(max_tokens=max_tokens, **params_kw)  # type: ignore[arg-type]
    ids = list(tokens) if tokens is not None else list(range(next(_bases), 0, -1))[:n]
    return Sequence(rid, ids, len(ids), params, eos_token_ids=frozenset({EOS}),
                    **kw)  # type: ignore[arg-type]


class Harness:
    def __init__(self, num_blocks: int, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 16, max_model_len: int = 1024) -> None:
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len)
        self.bm = BlockManager(num_blocks, BS, ROOT)
        self.sched = Scheduler(self.config, self.bm)
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token id whose KV is there
        self.steps = 0
        self.samples: list[bool] = []  # per chunk of the last step: did it sample?

    def add(self, *seqs: Sequence) -> None:
        for s in seqs:
            self.sched.add(s)

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // BS], pos % BS

    def step(self, token_fn: Callable[[Sequence], int] = fake_token) -> SchedulerOutput:
        out = self.sched.schedule()
        self.steps += 1
        assert out.num_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        seen = [id(c.seq) for c in out.chunks]
        assert len(seen) == len(set(seen)), "a sequence scheduled twice in one step"
        for p in out.preempted:
            assert p.num_preemptions >= 1
            # A victim may be re-admitted in the same step (its prefix can hit blocks that
            # others still hold); otherwise it waits, holding nothing, to be recomputed.
            if p.status is SequenceStatus.WAITING:
                assert p.block_table == [] and p.num_computed_tokens == 0
                assert p in self.sched.waiting
                assert id(p) not in seen
        # External KV arrives first.
        for load in out.loads:
            assert 0 <= load.first < load.end <= len(load.seq.block_table)
            for pos in range(load.first * BS, load.end * BS):
                self.kv[self._slot(load.seq, pos)] = load.seq.token_ids[pos]
        # The forward writes every chunk's KV ...
        for c in out.chunks:
            seq = c.seq
            assert seq.status is SequenceStatus.RUNNING
            assert c.num_tokens >= 1
            assert c.start == seq.num_computed_tokens
            assert c.start + c.num_tokens <= seq.num_tokens
            assert len(seq.block_table) >= self.bm.blocks_for(c.start + c.num_tokens)
            for pos in range(c.start, c.start + c.num_tokens):
                self.kv[self._slot(seq, pos)] = seq.token_ids[pos]
        # ... then attends over everything up to the chunk's end, which must be intact.
        for c in out.chunks:
            for pos in range(c.start + c.num_tokens):
                got = self.kv.get(self._slot(c.seq, pos))
                assert got == c.seq.token_ids[pos], (
                    f"{c.seq.request_id} position {pos}: KV holds {got}, "
                    f"expected {c.seq.token_ids[pos]}")
        # ``samples`` is judged against the sequence before commit appends the new token.
        self.samples = [c.samples for c in out.chunks]
        sampled = {id(c.seq): token_fn(c.seq) for c, smp in zip(out.chunks, self.samples,
                                                              strict=True) if smp}
        self.sched.commit(out, sampled)
        self.check_block_accounting()
        return out

    def check_block_accounting(self) -> None:
        refs = [0] * self.bm.num_blocks
        for s in self.sched.running:
            for b in s.block_table:
                refs[b] += 1
        for s in self.sched.waiting:
            assert s.block_table == []
        assert self.bm.ref_counts == refs
        assert set(self.bm.free_blocks) == {b for b, r in enumerate(refs) if r == 0}
        for h, b in self.bm.hash_to_block.items():
            assert self.bm.block_hash[b] == h

    def run(self, max_steps: int = 1000,
            token_fn: Callable[[Sequence], int] = fake_token) -> None:
        while self.sched.has_work:
            assert self.steps < max_steps, "scheduler made no progress"
            self.step(token_fn)


def reference_outputs(specs: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    """Outputs with an ample pool and budget (no chunking, no preemption)."""
    h = Harness(4096, max_num_batched_tokens=100_000)
    seqs = [make_seq(rid, 0, mt, tokens=toks) for rid, toks, mt in specs]
    h.add(*seqs)
    h.run()
    assert all(s.num_preemptions == 0 for s in seqs)
    return {s.request_id: s.output_token_ids for s in seqs}
