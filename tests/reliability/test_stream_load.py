"""The load harness's fairness figure (``LoadResult.ttft_over_neighbours``), on made-up runs.

It must stay near 1 when the whole machine slows (other test processes) and stand out when a
few requests wait behind later ones, or test_load's bound proves nothing either way.
"""

from __future__ import annotations

from stream_load import LoadResult, Outcome


def _run(ttft_at: list[tuple[float, float]]) -> LoadResult:
    result = LoadResult(duration=60.0)
    result.outcomes = [Outcome(start, start + ttft + 1.0, ttft, "ok") for start, ttft in ttft_at]
    return result


def test_a_slow_stretch_of_the_run_is_fair() -> None:
    # 2 s TTFTs, then 20 s ones for a stretch (the machine busy elsewhere), then 2 s again.
    run = _run([(i * 0.1, 20.0 if 200 <= i < 400 else 2.0) for i in range(600)])
    assert run.ttft_quantile(0.99) / run.ttft_quantile(0.5) >= 10  # the run-wide ratio moves
    assert run.ttft_over_neighbours(0.99, window=5.0) < 1.5


def test_requests_left_waiting_stand_out() -> None:
    # Two in a hundred wait 8x as long as the requests started beside them.
    run = _run([(i * 0.1, 16.0 if i % 50 == 7 else 2.0) for i in range(600)])
    assert run.ttft_over_neighbours(0.99, window=5.0) >= 7.9


def test_a_run_where_nothing_succeeded_reads_as_infinitely_unfair() -> None:
    run = _run([])
    assert run.ttft_over_neighbours(0.99, window=5.0) == run.ttft_quantile(0.5) == float("inf")
