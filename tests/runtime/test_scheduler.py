"""Scheduler: continuous batching, the token budget with chunked prefill, and admission.

The fake-model harness these tests drive lives in ``scheduler_support``.
"""

from __future__ import annotations

import random

import pytest
from scheduler_support import Harness, make_seq, reference_outputs

from cleave.runtime.engine.scheduler import ScheduledChunk, SchedulerConfig, SchedulerOutput
from cleave.runtime.engine.sequence import FinishReason, SequenceStatus


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
