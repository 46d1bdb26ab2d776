"""Scheduler: continuous batching, chunked prefill, preemption by recompute, external KV.

A fake "model" drives it: after ``schedule()`` every chunk's tokens are written into a fake KV
pool (one token id per slot), every position the chunk attends over is checked to hold the
right token, and chunks that reach the end of their sequence get a sampled token that is a
deterministic function of the sequence so far.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from cleave.kv_store.block_hash import KVFingerprint
from cleave.runtime.engine.block_manager import BlockManager
from cleave.runtime.engine.scheduler import (
    BlockLoad,
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from cleave.runtime.engine.sequence import (
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
)

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


# -- basics -------------------------------------------------------------------------------
def test_config_validation() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_model_len=1)


def test_chunk_samples_only_at_the_end() -> None:
    s = make_seq("a", 10)
    assert not ScheduledChunk(s, 0, 9).samples
    assert ScheduledChunk(s, 0, 10).samples
    assert ScheduledChunk(s, 6, 4).samples
    out = SchedulerOutput(chunks=[ScheduledChunk(s, 0, 3), ScheduledChunk(s, 3, 4)])
    assert out.num_tokens == 7


def test_single_request_runs_to_completion() -> None:
    h = Harness(16)
    s = make_seq("a", 6, max_tokens=5)
    h.add(s)
    out = h.step()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(s, 0, 6)]
    assert s.num_output_tokens == 1
    for _ in range(4):
        out = h.step()
        assert [(c.start, c.num_tokens) for c in out.chunks] == [(s.num_tokens - 2, 1)]
    assert s.is_finished and s.finish_reason is FinishReason.LENGTH
    assert s.num_output_tokens == 5
    assert not h.sched.has_work
    assert h.bm.num_free_blocks == 16


# -- token budget and chunked prefill -------------------------------------------------------
def test_token_budget_respected_every_step() -> None:
    rng = random.Random(0)
    h = Harness(64, max_num_batched_tokens=10)
    seqs = [make_seq(f"r{i}", rng.randint(1, 30), rng.randint(1, 6)) for i in range(12)]
    h.add(*seqs)
    budgets = []
    while h.sched.has_work:
        out = h.step()
        assert 0 < out.num_tokens <= 10
        budgets.append(out.num_tokens)
    assert max(budgets) == 10  # the budget is actually used, not just respected
    for s in seqs:
        assert s.finish_reason is FinishReason.LENGTH
        assert s.num_output_tokens == s.params.max_tokens


def test_long_prompt_is_chunked_while_decodes_keep_going() -> None:
    h = Harness(64, max_num_batched_tokens=8)
    a = make_seq("a", 3, max_tokens=50)
    b = make_seq("b", 3, max_tokens=50)
    h.add(a, b)
    h.step()  # both prefills fit: 6 tokens
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    long = make_seq("long", 30, max_tokens=3)
    h.add(long)
    starts = []
    for step in range(5):
        out = h.step()
        # Each running decode gets exactly one token, every step, ahead of the prefill.
        assert [c.seq.request_id for c in out.chunks] == ["a", "b", "long"]
        assert [c.num_tokens for c in out.chunks] == [1, 1, 6]
        assert h.samples == [True, True, step == 4]
        assert a.num_output_tokens == 2 + step and b.num_output_tokens == 2 + step
        starts.append(out.chunks[2].start)
    assert starts == [0, 6, 12, 18, 24]
    assert long.num_computed_tokens == 30 and long.num_output_tokens == 1
    h.run()
    assert long.output_token_ids == reference_outputs([("x", long.token_ids[:30], 3)])["x"]


def test_budget_smaller_than_running_decodes() -> None:
    h = Harness(64, max_num_batched_tokens=2, max_num_seqs=8)
    seqs = [make_seq(f"r{i}", 1, max_tokens=4) for i in range(4)]
    h.add(*seqs)
    h.run()
    for s in seqs:
        assert s.num_output_tokens == 4


def test_requests_joining_mid_run_are_admitted() -> None:
    h = Harness(64, max_num_batched_tokens=32)
    a = make_seq("a", 5, max_tokens=10)
    h.add(a)
    h.step()
    h.step()
    b = make_seq("b", 7, max_tokens=3)
    h.add(b)
    out = h.step()
    assert [c.seq for c in out.chunks] == [a, b]
    assert out.chunks[1].start == 0 and out.chunks[1].num_tokens == 7
    assert b.status is SequenceStatus.RUNNING and b.num_output_tokens == 1
    h.run()
    assert a.num_output_tokens == 10 and b.num_output_tokens == 3


# -- admission ------------------------------------------------------------------------------
def test_max_num_seqs_respected() -> None:
    h = Harness(64, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(f"r{i}", 4, max_tokens=3) for i in range(5)]
    h.add(*seqs)
    out = h.step()
    assert [c.seq for c in out.chunks] == seqs[:2]
    assert len(h.sched.waiting) == 3
    max_running = 0
    while h.sched.has_work:
        h.step()
        max_running = max(max_running, len(h.sched.running))
    assert max_running == 2
    assert all(s.num_output_tokens == 3 for s in seqs)


def test_fcfs_admission_order() -> None:
    h = Harness(64, max_num_seqs=64, max_num_batched_tokens=100)
    seqs = [make_seq(f"r{i}", 3 + i, max_tokens=2) for i in range(4)]
    h.add(*seqs)
    out = h.step()
    assert [c.seq for c in out.chunks] == seqs
    assert h.sched.running == seqs


def test_fcfs_small_request_does_not_jump_a_blocked_one() -> None:
    h = Harness(8, max_num_batched_tokens=100)
    a = make_seq("a", 17, max_tokens=3)  # 5 blocks, then 5 (18th token fits block 5)
    h.add(a)
    h.step()
    big = make_seq("big", 16, max_tokens=1)  # needs 4 blocks, only 3 free
    small = make_seq("small", 2, max_tokens=1)  # needs 1 block: would fit
    h.add(big, small)
    out = h.step()
    assert [c.seq for c in out.chunks] == [a]
    assert list(h.sched.waiting) == [big, small]
    h.run()
    assert big.finish_reason is FinishReason.LENGTH
    assert small.finish_reason is FinishReason.LENGTH


def test_budget_exhausted_by_prefill_stops_admission() -> None:
    h = Harness(64, max_num_batched_tokens=8)
    a = make_seq("a", 20, max_tokens=1)
    b = make_seq("b", 2, max_tokens=1)
    h.add(a, b)
    out = h.step()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 8)]
    assert list(h.sched.waiting) == [b]


# -- preemption -----------------------------------------------------------------------------
def test_preemption_of_youngest_when_blocks_run_out() -> None:
    h = Harness(6, max_num_seqs=3, max_num_batched_tokens=64)
    a, b, c = (make_seq(r, 4, max_tokens=12) for r in "abc")
    d = make_seq("d", 4, max_tokens=2)  # waits for a slot (max_num_seqs=3)
    specs = [(s.request_id, list(s.token_ids), s.params.max_tokens) for s in (a, b, c, d)]
    h.add(a, b, c, d)
    first_preemption = None
    while h.sched.has_work:
        out = h.step()
        if out.preempted and first_preemption is None:
            first_preemption = out
            assert out.preempted == [c]
            assert c.block_table == []
            assert c.num_computed_tokens == 0
            assert c.status is SequenceStatus.WAITING
            assert c.num_preemptions == 1
            assert list(h.sched.waiting)[:2] == [c, d]
            assert h.sched.running == [a, b]
            assert [ch.seq for ch in out.chunks] == [a, b]
            # The KV pool usage drops by what c held and is regained by a and b growing.
            assert a.num_preemptions == 0 and b.num_preemptions == 0
    assert first_preemption is not None
    expected = reference_outputs(specs)
    for s in (a, b, c, d):
        assert s.finish_reason is FinishReason.LENGTH
        assert s.output_token_ids == expected[s.request_id], s.request_id
    assert h.bm.num_free_blocks == 6


def test_preempted_sequence_resumes_from_its_outputs() -> None:
    h = Harness(4, max_num_batched_tokens=64)
    a = make_seq("a", 4, max_tokens=8)  # 12 tokens: 3 blocks
    b = make_seq("b", 4, max_tokens=8)
    h.add(a, b)
    h.step()
    while b.num_preemptions == 0:
        assert h.sched.has_work
        h.step()
    # Once re-admitted, b recomputes its prompt and outputs so far, then samples next.
    outputs_at_preemption = b.num_output_tokens
    assert outputs_at_preemption >= 1
    while b.status is not SequenceStatus.RUNNING:
        h.step()
    assert b.num_output_tokens == outputs_at_preemption + 1
    h.run()
    expected = reference_outputs([("a", a.token_ids[:4], 8), ("b", b.token_ids[:4], 8)])
    assert a.output_token_ids == expected["a"]
    assert b.output_token_ids == expected["b"]


def test_self_preemption_when_alone_cannot_grow() -> None:
    # Only one sequence per step can run; the younger one is preempted repeatedly but both
    # complete correctly and no block is leaked.
    h = Harness(3, max_num_batched_tokens=64)
    a = make_seq("a", 3, max_tokens=6)  # 9 tokens: 3 blocks
    b = make_seq("b", 3, max_tokens=6)
    h.add(a, b)
    h.run(max_steps=200)
    expected = reference_outputs([("a", a.token_ids[:3], 6), ("b", b.token_ids[:3], 6)])
    assert a.output_token_ids == expected["a"]
    assert b.output_token_ids == expected["b"]
    assert b.num_preemptions >= 1
    assert h.bm.num_free_blocks == 3


def test_random_workload_under_pressure_matches_reference() -> None:
    rng = random.Random(1234)
    shared = [rng.randrange(3, 400) for _ in range(12)]
    specs = []
    for i in range(25):
        n = rng.randint(1, 22)
        toks = [rng.randrange(3, 400) for _ in range(n)]
        if i % 3 == 0:
            toks = shared[: rng.randint(4, 12)] + toks  # shared prefixes exercise caching
        specs.append((f"r{i}", toks, rng.randint(1, 10)))
    h = Harness(12, max_num_seqs=6, max_num_batched_tokens=12)
    seqs = [make_seq(rid, 0, mt, tokens=toks) for rid, toks, mt in specs]
    pending = list(seqs)
    while pending or h.sched.has_work:
        for _ in range(rng.randint(0, 2)):
            if pending:
                h.add(pending.pop(0))
        if h.sched.has_work:
            h.step()
        assert h.steps < 3000
    expected = reference_outputs(specs)
    assert sum(s.num_preemptions for s in seqs) > 0  # the pool really was under pressure
    assert sum(s.num_cached_tokens for s in seqs) > 0  # and prefixes really were reused
    for s in seqs:
        assert s.is_finished
        assert s.output_token_ids == expected[s.request_id], s.request_id
    assert h.bm.num_free_blocks == 12


# -- commit and finishing -------------------------------------------------------------------
def test_commit_appends_tokens_and_returns_updated_in_chunk_order() -> None:
    h = Harness(64, max_num_batched_tokens=10)
    a = make_seq("a", 3, max_tokens=5)
    b = make_seq("b", 12, max_tokens=5)
    h.add(a, b)
    out = h.sched.schedule()
    assert [(c.seq, c.num_tokens, c.samples) for c in out.chunks] == [(a, 3, True), (b, 7, False)]
    updated = h.sched.commit(out, {id(a): 77})
    assert updated == [a]
    assert a.token_ids[-1] == 77 and a.num_computed_tokens == 3
    assert b.num_computed_tokens == 7 and b.num_output_tokens == 0
    out = h.sched.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(a, 3, 1), (b, 7, 5)]
    assert h.sched.commit(out, {id(a): 78, id(b): 79}) == [a, b]
    assert a.output_token_ids == [77, 78] and b.output_token_ids == [79]


def _finish_one(seq: Sequence, token_fn: Callable[[Sequence], int],
                **harness_kw: int) -> Harness:
    h = Harness(64, **harness_kw)
    h.add(seq)
    h.run(token_fn=token_fn)
    assert seq.is_finished
    assert seq.block_table == []
    assert h.sched.running == [] and not h.sched.waiting
    assert h.bm.num_free_blocks == 64
    return h


def _tokens_then(eos_at: int, token: int) -> Callable[[Sequence], int]:
    return lambda s: token if s.num_output_tokens == eos_at else 300 + s.num_output_tokens


def test_finish_on_max_tokens() -> None:
    s = make_seq("a", 5, max_tokens=7)
    _finish_one(s, fake_token)
    assert s.finish_reason is FinishReason.LENGTH
    assert s.num_output_tokens == 7


def test_finish_on_max_model_len() -> None:
    s = make_seq("a", 6, max_tokens=100)
    _finish_one(s, fake_token, max_model_len=10)
    assert s.finish_reason is FinishReason.LENGTH
    assert s.num_tokens == 10


def test_finish_on_eos() -> None:
    s = make_seq("a", 5, max_tokens=10)
    _finish_one(s, _tokens_then(3, EOS))
    assert s.finish_reason is FinishReason.STOP
    assert s.output_token_ids == [300, 301, 302, EOS]


def test_ignore_eos_runs_to_max_tokens() -> None:
    s = make_seq("a", 5, max_tokens=6, ignore_eos=True)
    _finish_one(s, lambda q: EOS)
    assert s.finish_reason is FinishReason.LENGTH
    assert s.output_token_ids == [EOS] * 6


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    s = make_seq("a", 5, max_tokens=10, stop_token_ids=(9, 11), ignore_eos=True)
    _finish_one(s, _tokens_then(2, 11))
    assert s.finish_reason is FinishReason.STOP
    assert s.output_token_ids == [300, 301, 11]


def test_prefill_only_finishes_after_first_token() -> None:
    s = make_seq("a", 9, max_tokens=10, prefill_only=True)
    h = Harness(64, max_num_batched_tokens=4)
    h.add(s)
    h.run()
    assert h.steps == 3  # 4 + 4 + 1 prompt tokens, then done
    assert s.finish_reason is FinishReason.PREFILL_DONE
    assert s.num_output_tokens == 1
    assert s.block_table == [] and h.bm.num_free_blocks == 64


def test_finished_sequence_blocks_stay_cached_for_prefix_reuse() -> None:
    h = Harness(64, max_num_batched_tokens=64)
    toks = list(range(10, 23))  # 13 tokens
    a = make_seq("a", 0, 1, tokens=toks)
    h.add(a)
    h.run()
    b = make_seq("b", 0, 1, tokens=toks)
    h.add(b)
    out = h.step()
    assert b.num_cached_tokens == 12
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(12, 1)]


# -- abort ----------------------------------------------------------------------------------
def test_abort_running_frees_blocks() -> None:
    h = Harness(16, max_num_batched_tokens=64)
    a = make_seq("a", 9, max_tokens=10)
    b = make_seq("b", 5, max_tokens=10)
    h.add(a, b)
    h.step()
    assert h.bm.num_free_blocks == 16 - 3 - 2
    assert h.sched.abort("a") is a
    assert a.finish_reason is FinishReason.ABORT and a.is_finished
    assert a.block_table == []
    assert h.sched.running == [b]
    assert h.bm.num_free_blocks == 16 - 2
    h.check_block_accounting()
    assert h.sched.abort("a") is None  # already gone
    h.run()
    assert b.finish_reason is FinishReason.LENGTH


def test_abort_waiting_and_unknown() -> None:
    h = Harness(16, max_num_seqs=1)
    a = make_seq("a", 3, max_tokens=3)
    b = make_seq("b", 3, max_tokens=3)
    h.add(a, b)
    h.step()
    assert h.sched.abort("b") is b
    assert b.finish_reason is FinishReason.ABORT
    assert not h.sched.waiting
    assert h.sched.abort("nope") is None
    h.run()
    assert a.finish_reason is FinishReason.LENGTH


# -- external KV ----------------------------------------------------------------------------
def test_external_kv_loads_and_skips_the_prompt() -> None:
    h = Harness(16, max_num_batched_tokens=64)
    # Decode side: prompt of 12 plus the first token sampled by the prefill worker.
    s = make_seq("a", 12, max_tokens=4, num_external_blocks=3)
    s.token_ids.append(123)
    out = h.step()  # nothing added yet
    assert out.chunks == []
    h.add(s)
    out = h.step()
    assert out.loads == [BlockLoad(s, 0, 3)]
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(12, 1)]
    assert h.samples == [True]
    h.run()
    assert s.num_output_tokens == 4


def test_external_kv_capped_so_last_token_is_computed() -> None:
    h = Harness(16, max_num_batched_tokens=64)
    s = make_seq("a", 12, max_tokens=2, num_external_blocks=3)  # no first token appended
    h.add(s)
    out = h.sched.schedule()
    assert out.loads == [BlockLoad(s, 0, 2)]
    assert s.num_computed_tokens == 8
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(8, 4)]


def test_external_kv_more_blocks_than_tokens() -> None:
    h = Harness(16, max_num_batched_tokens=64)
    s = make_seq("a", 6, max_tokens=2, num_external_blocks=5)
    h.add(s)
    out = h.sched.schedule()
    assert out.loads == [BlockLoad(s, 0, 1)]
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(4, 2)]


def test_external_kv_after_local_prefix_hits() -> None:
    h = Harness(32, max_num_batched_tokens=64)
    toks = list(range(50, 63))  # 13 tokens
    warm = make_seq("warm", 0, 1, tokens=toks[:5])  # publishes block 0
    h.add(warm)
    h.run()
    s = make_seq("a", 0, 2, tokens=toks, num_external_blocks=3)
    h.add(s)
    out = h.step()
    assert s.num_cached_tokens == 4
    assert out.loads == [BlockLoad(s, 1, 3)]
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(12, 1)]


def test_external_kv_not_loaded_when_local_hits_cover_it() -> None:
    h = Harness(32, max_num_batched_tokens=64)
    toks = list(range(50, 63))
    warm = make_seq("warm", 0, 1, tokens=toks)
    h.add(warm)
    h.run()
    s = make_seq("a", 0, 2, tokens=toks, num_external_blocks=2)
    h.add(s)
    out = h.step()
    assert out.loads == []
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(12, 1)]


def test_external_kv_chunked_after_load() -> None:
    h = Harness(32, max_num_batched_tokens=3)
    s = make_seq("a", 14, max_tokens=1, num_external_blocks=2)
    h.add(s)
    out = h.step()
    assert out.loads == [BlockLoad(s, 0, 2)]
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(8, 3)]
    out = h.step()
    assert out.loads == []
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(11, 3)]
    assert s.finish_reason is FinishReason.LENGTH


def test_preemption_forgets_external_blocks() -> None:
    h = Harness(4, max_num_batched_tokens=64)
    a = make_seq("a", 4, max_tokens=8)
    b = make_seq("b", 8, max_tokens=8, num_external_blocks=2)
    h.add(a, b)
    out = h.step()
    assert out.loads == [BlockLoad(b, 0, 1)]
    while b.num_preemptions == 0:
        h.step()
    assert b.num_external_blocks == 0
    h.run()
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("chunk", range(4))
def test_randomized_configs_keep_kv_intact_and_outputs_exact(chunk: int) -> None:
    """Many small random pools/budgets with shared prefixes, external KV and aborts.

    Every step the harness checks the token budget, max_num_seqs, block accounting and that
    every position attended over holds the right token; at the end every non-aborted output
    must equal an unconstrained reference run and every block must be free again.
    """
    for seed in range(chunk * 100, chunk * 100 + 100):
        rng = random.Random(seed)
        num_blocks = rng.randint(4, 24)
        shared = [rng.randrange(3, 50) for _ in range(16)]
        specs = []
        for i in range(rng.randint(1, 15)):
            toks = [rng.randrange(3, 50) for _ in range(rng.randint(1, 14))]
            if rng.random() < 0.5:
                toks = shared[: rng.randint(1, 16)] + toks
            max_tokens = rng.randint(1, 8)
            if -(-(len(toks) + max_tokens) // BS) > num_blocks:
                continue  # the engine rejects these up front
            external = rng.randint(0, 4) if rng.random() < 0.3 else 0
            specs.append((f"r{i}", toks, max_tokens, external))
        h = Harness(num_blocks, max_num_seqs=rng.randint(1, 8),
                    max_num_batched_tokens=rng.randint(1, 20))
        seqs = [make_seq(r, 0, mt, tokens=t, num_external_blocks=e) for r, t, mt, e in specs]
        pending = list(seqs)
        aborted = set()
        while pending or h.sched.has_work:
            for _ in range(rng.randint(0, 2)):
                if pending:
                    h.add(pending.pop(0))
            if h.sched.running and rng.random() < 0.03:
                victim = rng.choice(h.sched.running)
                assert h.sched.abort(victim.request_id) is victim
                aborted.add(victim.request_id)
            if h.sched.has_work:
                h.step()
            assert h.steps < 5000, f"seed {seed}: no progress"
        expected = reference_outputs([(r, t, mt) for r, t, mt, _ in specs])
        for s in seqs:
            assert s.is_finished
            if s.request_id in aborted:
                assert s.finish_reason is FinishReason.ABORT
            else:
                assert s.output_token_ids == expected[s.request_id], (seed, s.request_id)
        assert h.bm.num_free_blocks == num_blocks, seed
