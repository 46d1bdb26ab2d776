"""Routing decisions: conditional disaggregation, prefix affinity, load and KV capacity."""

from __future__ import annotations

import pytest

from cleave.runtime.serving.routing import (
    WorkerState,
    choose_decode,
    choose_path,
    choose_prefill,
    choose_server,
    predicted_prefill_seconds,
    updated_rate,
)


def test_short_and_mostly_cached_prompts_skip_the_prefill_worker() -> None:
    assert choose_path(1000, 0, True, 64).disaggregate
    assert choose_path(1000, 0, True, 64).reason == "long_prompt"
    assert choose_path(20, 0, True, 64) == choose_path(63, 0, True, 64)
    assert choose_path(20, 0, True, 64).reason == "short_prompt"
    mostly = choose_path(1000, 960, True, 64)
    assert not mostly.disaggregate and mostly.reason == "mostly_cached"
    assert choose_path(1000, 0, False, 64).reason == "no_prefill_workers"


def test_prefix_affinity_is_stable_and_spreads_prefixes() -> None:
    workers = [WorkerState(f"http://w{i}") for i in range(4)]
    picks = {choose_prefill(workers, f"prefix-{k}".encode()).url  # type: ignore[union-attr]
             for k in range(64)}
    assert len(picks) == 4  # different prefixes land on different workers
    first = choose_prefill(workers, b"same")
    assert all(choose_prefill(workers, b"same") == first for _ in range(5))
    # Removing another worker does not move this prefix (rendezvous hashing).
    others = [w for w in workers if w != first]
    assert choose_prefill([first, *others[1:]], b"same") == first  # type: ignore[list-item]


def test_load_overrides_affinity_past_the_imbalance_bound() -> None:
    workers = [WorkerState("http://a"), WorkerState("http://b")]
    preferred = choose_prefill(workers, b"k")
    assert preferred is not None
    loaded = [WorkerState(w.url, inflight=5 if w.url == preferred.url else 0) for w in workers]
    moved = choose_prefill(loaded, b"k")
    assert moved is not None and moved.url != preferred.url
    slightly = [WorkerState(w.url, inflight=2 if w.url == preferred.url else 0)
                for w in workers]
    assert choose_prefill(slightly, b"k") == slightly[[w.url for w in workers].index(
        preferred.url)]


def test_unhealthy_workers_are_never_chosen() -> None:
    workers = [WorkerState("http://a", healthy=False), WorkerState("http://b", healthy=False)]
    assert choose_prefill(workers, b"k") is None
    assert choose_decode(workers) is None


def test_decode_prefers_free_kv_then_fewer_requests_and_honours_exclusions() -> None:
    full = WorkerState("http://full", kv_usage=0.9)
    busy = WorkerState("http://busy", kv_usage=0.1, inflight=3)
    idle = WorkerState("http://idle", kv_usage=0.1)
    assert choose_decode([full, busy, idle]) == idle
    assert choose_decode([full, busy]) == busy
    assert choose_decode([full, busy, idle], frozenset({"http://idle"})) == busy
    assert choose_decode([idle], frozenset({"http://idle"})) is None


def test_a_prefill_backlog_past_the_ttft_target_skips_the_prefill_worker() -> None:
    backlog = {"ttft_target": 2.0, "tokens_ahead": 3000}
    assert choose_path(1000, 0, True, 64, predicted_ttft=2.5, **backlog).reason == \
        "prefill_backlog"
    assert choose_path(1000, 0, True, 64, predicted_ttft=1.5, **backlog).disaggregate
    assert choose_path(1000, 0, True, 64, predicted_ttft=None, **backlog).disaggregate
    assert choose_path(1000, 0, True, 64, predicted_ttft=9.0, ttft_target=None,
                       tokens_ahead=3000).disaggregate


def test_a_prompt_too_long_for_the_target_on_an_idle_prefill_worker_is_still_disaggregated(
        ) -> None:
    """No queue to skip: the decode worker would take as long (and slow its decodes), and
    the prompt's KV would never reach the store for the next one sharing its prefix."""
    alone = choose_path(1000, 0, True, 64, predicted_ttft=9.0, ttft_target=2.0, tokens_ahead=0)
    assert alone.disaggregate and alone.reason == "long_prompt"


def test_a_prefill_is_predicted_from_the_tokens_queued_ahead_at_the_observed_speed() -> None:
    busy = WorkerState("http://p", queued_tokens=3000)
    assert predicted_prefill_seconds(busy, 1000, 0.001) == pytest.approx(4.0)
    assert predicted_prefill_seconds(busy, 1000, None) is None
    rate = updated_rate(None, 2.0, 1000)
    assert rate == pytest.approx(0.002)
    assert updated_rate(rate, 4.0, 1000) == pytest.approx(0.8 * 0.002 + 0.2 * 0.004)
    assert updated_rate(rate, 1.0, 0) == rate  # nothing learned from an empty prefill


def test_a_prefill_worker_serves_whole_when_no_decode_worker_is_healthy() -> None:
    decode = [WorkerState("http://d", healthy=False)]
    prefill = [WorkerState("http://p1", inflight=2), WorkerState("http://p2")]
    assert choose_server(decode, prefill) == ("prefill", prefill[1])
    up = [WorkerState("http://d")]
    assert choose_server(up, prefill) == ("decode", up[0])
    assert choose_server(decode, prefill, frozenset({"http://p1", "http://p2"})) is None
