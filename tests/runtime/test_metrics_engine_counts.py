"""The engine's own counting for vLLM's series, without Prometheus: prefix-cache queries and
hits in the block manager (tokens, on admission), and each request's clock (queue, prefill,
decode, inference) on its last output, on the tiny engine."""

from __future__ import annotations

from block_manager_support import BS, ROOT, computed, make_seq, prompt

from cleave.runtime.engine.block_manager import BlockManager
from cleave.runtime.engine.outputs import RequestOutput
from cleave.runtime.engine.sequence import SamplingParams


def test_prefix_cache_counts_queried_and_hit_tokens_on_admission() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, root_hash=ROOT)
    first = make_seq(prompt(3 * BS + 1))
    assert bm.allocate(first)
    computed(bm, first)
    assert (bm.prefix_queried_tokens, bm.prefix_hit_tokens) == (3 * BS + 1, 0)
    again = make_seq(prompt(3 * BS + 1))
    assert bm.allocate(again)
    assert (bm.prefix_queried_tokens, bm.prefix_hit_tokens) == (2 * (3 * BS + 1), 3 * BS)
    # Refused for room: nothing is counted, the lookup happens again when it is admitted.
    big = make_seq(prompt(9 * BS, base=5000))
    assert not bm.allocate(big)
    assert bm.prefix_queried_tokens == 2 * (3 * BS + 1)


def _last(engine: object, rid: str) -> RequestOutput:
    last = None
    while engine.has_unfinished:  # type: ignore[attr-defined]
        for out in engine.step():  # type: ignore[attr-defined]
            if out.request_id == rid:
                last = out
    assert last is not None and last.finished
    return last


def test_a_finished_request_carries_its_intervals(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(max_num_batched_tokens=16)
    steps: list[int] = []
    engine.step_observer = steps.append
    engine.add_request("a", list(range(10, 50)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("b", list(range(60, 70)), SamplingParams(max_tokens=3, ignore_eos=True))
    times = _last(engine, "b").times
    assert times is not None
    # b waits behind a's 40-token prompt, chunked 16 a step: it is not admitted at once.
    assert times.queue > 0 and times.prefill > 0 and times.decode > 0
    assert abs(times.inference - (times.prefill + times.decode)) < 1e-9
    assert sum(steps) == engine.stats.prompt_tokens_computed + engine.stats.generated_tokens \
        - 2  # each request's first token is sampled in the step that ends its prompt
    assert max(steps) <= 16
    assert not engine._clocks  # released with the requests
