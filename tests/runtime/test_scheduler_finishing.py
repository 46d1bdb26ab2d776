"""Scheduler: committing sampled tokens, every way a sequence finishes, and aborts.

The fake-model harness these tests drive lives in ``scheduler_support``.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_support import EOS, Harness, fake_token, make_seq

from cleave.runtime.engine.sequence import FinishReason, Sequence


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
