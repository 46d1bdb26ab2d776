"""Scheduler: preemption by recompute, external KV loads, and randomized workloads under pressure.

The fake-model harness these tests drive lives in ``scheduler_support``.
"""

from __future__ import annotations

import random

import pytest
from scheduler_support import BS, Harness, make_seq, reference_outputs

from cleave.runtime.engine.scheduler import BlockLoad
from cleave.runtime.engine.sequence import FinishReason, SequenceStatus


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
