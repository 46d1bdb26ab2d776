"""Autoscaler signals: real prometheus-client exposition in, windowed role signals out."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cleave.autoscaling.pods import PodCounts
from cleave.autoscaling.signals import (
    SignalCollector,
    Target,
    collect,
    histogram_quantile,
    parse_metrics,
    scrape,
)
from cleave.common import metric_names as names

BUCKETS = (0.1, 0.2, 0.5, 1.0, 2.0)


class FakeWorker:
    """One worker's metrics, produced by prometheus-client exactly as a real worker does."""

    def __init__(self, role: str) -> None:
        self.role = role
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(names.TTFT, "", ["role"],
                              buckets=BUCKETS, registry=r).labels(role)
        self.tpot = Histogram(names.TPOT, "", ["role"],
                              buckets=BUCKETS, registry=r).labels(role)
        self.prompt = Counter(names.PROMPT_TOKENS, "", ["role"], registry=r).labels(role)
        self.gen = Counter(names.GENERATION_TOKENS, "", ["role"], registry=r).labels(role)
        self.waiting = Gauge(names.WAITING, "", ["role"], registry=r).labels(role)
        self.kv = Gauge(names.KV_USAGE, "", ["role"], registry=r).labels(role)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_parse_sums_label_sets_and_drops_created_samples() -> None:
    w = FakeWorker("prefill")
    w.ttft.observe(0.15)
    w.ttft.observe(0.7)
    w.prompt.inc(100)
    w.kv.set(0.25)
    m = parse_metrics(w.text())
    h = m.histograms[names.TTFT]
    assert h.bounds == (*BUCKETS, math.inf)
    assert h.cumulative == (0, 1, 1, 2, 2, 2)
    assert h.count == 2 and h.total == pytest.approx(0.85)
    assert m.values[names.PROMPT_TOKENS] == 100
    assert m.values[names.KV_USAGE] == 0.25
    assert not any(k.endswith("_created") for k in m.values)
    assert m.roles == {"prefill"}


def test_parse_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_metrics("this is { not prometheus\n")


def test_quantile_uses_only_observations_between_scrapes() -> None:
    w = FakeWorker("prefill")
    for _ in range(100):
        w.ttft.observe(1.5)  # old, slow history
    before = parse_metrics(w.text()).histograms[names.TTFT]
    for _ in range(10):
        w.ttft.observe(0.15)  # the recent window is fast
    after = parse_metrics(w.text()).histograms[names.TTFT]
    p90 = histogram_quantile(0.9, before, after)
    assert p90 is not None and 0.1 < p90 <= 0.2
    assert histogram_quantile(0.9, after, after) is None  # nothing happened in between
    # A counter reset (the pod restarted) counts from zero instead of going negative.
    assert histogram_quantile(0.5, after, before) == pytest.approx(1.0 + 1.0 * 0.5 * 100 / 100)


def test_quantile_past_last_bucket_reports_last_finite_bound() -> None:
    w = FakeWorker("decode")
    w.tpot.observe(30.0)
    h = parse_metrics(w.text()).histograms[names.TPOT]
    assert histogram_quantile(0.9, None, h) == 2.0


def _feed(c: SignalCollector, pod: str, w: FakeWorker, at: float) -> None:
    c.record(pod, w.role, at, parse_metrics(w.text()))


def test_role_signals_windowed_over_pods() -> None:
    c = SignalCollector(window_s=30, stale_after_s=20)
    a, b = FakeWorker("decode"), FakeWorker("both")  # a colocated worker counts as decode
    b.waiting.set(2)  # b has a standing queue: what it serves is what one replica can do
    a.waiting.set(1)  # a's queue empties: one caught request is no saturation
    for w in (a, b):
        _feed(c, w.role + "-pod", w, 0.0)
    for _ in range(9):
        a.tpot.observe(0.05)
    b.tpot.observe(1.5)  # one slow token in ten: p90 sits at the top of the fast bucket
    a.gen.inc(300)
    b.gen.inc(300)
    a.kv.set(0.5)
    b.kv.set(0.7)
    b.waiting.set(3)
    a.waiting.set(0)
    for w in (a, b):
        _feed(c, w.role + "-pod", w, 30.0)
    s = c.role_signals("decode", 30.0, ready=2, starting=1, pending=0)
    assert s.latency_p90 is not None and s.latency_p90 <= 0.1 + 1e-9
    assert s.token_rate == pytest.approx(20.0)  # 600 tokens over 30 s
    assert s.kv_usage == pytest.approx(0.6)
    assert s.queue_depth == 3
    assert s.throughput_per_replica == pytest.approx(10.0)  # b was queued: 300 tok / 30 s
    assert (s.ready, s.starting, s.pending) == (2, 1, 0)
    assert s.request_rate is None  # served requests/s feed prefill's demand model only
    assert c.role_signals("prefill", 30.0, ready=1, starting=0, pending=0).latency_p90 is None


def test_prefill_request_rate_counts_first_tokens_in_the_window() -> None:
    c = SignalCollector(window_s=30, stale_after_s=20)
    w = FakeWorker("prefill")
    for _ in range(50):
        w.ttft.observe(0.3)  # before the window: not counted
    _feed(c, "p0", w, 0.0)
    for _ in range(60):
        w.ttft.observe(0.3)
    w.waiting.set(1)  # queued only at the end: no saturated throughput
    w.prompt.inc(6000)
    _feed(c, "p0", w, 30.0)
    s = c.role_signals("prefill", 30.0, ready=1, starting=0, pending=0)
    assert s.request_rate == pytest.approx(2.0)
    assert s.token_rate == pytest.approx(200.0)
    assert s.throughput_per_replica is None


def test_a_restarted_pod_counts_its_new_counters_as_all_new() -> None:
    """A pod whose counters went backwards restarted: what it counts now all happened since
    (the token rate and the request rate share the windowed-rate code)."""
    c = SignalCollector(window_s=30, stale_after_s=20)
    before = FakeWorker("prefill")
    for _ in range(50):
        before.ttft.observe(0.3)
    before.prompt.inc(5000)
    _feed(c, "p0", before, 0.0)
    after = FakeWorker("prefill")  # the same pod name, a fresh process
    for _ in range(30):
        after.ttft.observe(0.3)
    after.prompt.inc(3000)
    _feed(c, "p0", after, 30.0)
    s = c.role_signals("prefill", 30.0, ready=1, starting=0, pending=0)
    assert s.request_rate == pytest.approx(1.0)
    assert s.token_rate == pytest.approx(100.0)


def test_first_scrape_is_no_window_and_failed_scrape_is_stale() -> None:
    c = SignalCollector(window_s=30, stale_after_s=20)
    w = FakeWorker("prefill")
    w.ttft.observe(5.0)
    _feed(c, "p0", w, 0.0)
    s = c.role_signals("prefill", 0.0, ready=1, starting=0, pending=0)
    assert s.latency_p90 is None and s.token_rate is None  # history since start is no window
    _feed(c, "p0", w, 15.0)
    assert c.role_signals("prefill", 15.0, ready=1, starting=0, pending=0).token_rate == 0.0
    c.record("p0", "prefill", 30.0, None)  # it stopped answering: stale, not fast
    s = c.role_signals("prefill", 30.0, ready=1, starting=0, pending=0)
    assert s.latency_p90 is None and s.token_rate is None and s.queue_depth is None
    _feed(c, "p0", w, 45.0)
    assert c.role_signals("prefill", 70.0, ready=1, starting=0, pending=0).token_rate is None


def test_failed_scrape_after_the_baseline_keeps_the_baseline() -> None:
    c = SignalCollector(window_s=20, stale_after_s=60)
    w = FakeWorker("decode")
    _feed(c, "d0", w, 0.0)
    c.record("d0", "decode", 10.0, None)
    w.gen.inc(400)
    _feed(c, "d0", w, 40.0)  # the answer at 0 is still the newest one a window old
    s = c.role_signals("decode", 40.0, ready=1, starting=0, pending=0)
    assert s.token_rate == pytest.approx(10.0)


def test_window_slides_so_old_slowness_ages_out() -> None:
    c = SignalCollector(window_s=20, stale_after_s=20)
    w = FakeWorker("prefill")
    _feed(c, "p0", w, 0.0)
    for _ in range(20):
        w.ttft.observe(1.5)
    _feed(c, "p0", w, 10.0)
    p_slow = c.role_signals("prefill", 10.0, ready=1, starting=0, pending=0).latency_p90
    assert p_slow is not None and p_slow > 1.0
    for t in (20.0, 30.0, 40.0):
        for _ in range(20):
            w.ttft.observe(0.15)
        _feed(c, "p0", w, t)
    p_fast = c.role_signals("prefill", 40.0, ready=1, starting=0, pending=0).latency_p90
    assert p_fast is not None and p_fast <= 0.2


def test_role_at_zero_is_woken_by_requests_held_in_the_router() -> None:
    c = SignalCollector(window_s=30, stale_after_s=20)
    router = FakeWorker("router")
    _feed(c, "router-0", router, 0.0)
    idle = c.role_signals("decode", 0.0, ready=0, starting=0, pending=0)
    assert idle.queue_depth == 0 and idle.token_rate == 0
    router.waiting.set(2)
    _feed(c, "router-0", router, 10.0)
    woken = c.role_signals("decode", 10.0, ready=0, starting=0, pending=0)
    assert woken.queue_depth == 2
    # Replicas that exist but never answered are unknown, not idle.
    assert c.role_signals("decode", 10.0, ready=1, starting=0, pending=0).queue_depth is None


def test_forget_drops_deleted_pods() -> None:
    c = SignalCollector(window_s=30, stale_after_s=20)
    w = FakeWorker("decode")
    w.kv.set(0.9)
    _feed(c, "gone", w, 0.0)
    c.forget(["other"])
    assert c.role_signals("decode", 0.0, ready=1, starting=0, pending=0).kv_usage is None


async def test_scrape_real_http_server() -> None:
    w = FakeWorker("decode")
    w.kv.set(0.4)

    async def good(_: web.Request) -> web.Response:
        return web.Response(text=w.text())

    async def broken(_: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text="{{{ not metrics")

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(text=w.text())

    app = web.Application()
    app.router.add_get("/metrics", good)
    app.router.add_get("/broken", broken)
    app.router.add_get("/garbage", garbage)
    app.router.add_get("/slow", slow)
    server = TestServer(app)
    await server.start_server()
    base = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as session:
            m = await scrape(session, f"{base}/metrics", 2.0)
            assert m is not None and m.values[names.KV_USAGE] == 0.4
            assert await scrape(session, f"{base}/broken", 2.0) is None
            assert await scrape(session, f"{base}/garbage", 2.0) is None
            loop = asyncio.get_running_loop()
            start = loop.time()
            assert await scrape(session, f"{base}/slow", 0.3) is None
            assert loop.time() - start < 2.0
            assert await scrape(session, "http://127.0.0.1:1/metrics", 1.0) is None
    finally:
        await server.close()


async def test_collect_is_one_interval_of_either_backend() -> None:
    """Scrape all targets at once (bounded), failures as stale, vanished targets forgotten."""
    decode, router = FakeWorker("decode"), FakeWorker("router")
    decode.kv.set(0.5)
    router.waiting.set(3)  # requests the router holds
    hung = asyncio.Event()

    async def metrics_of(request: web.Request) -> web.Response:
        return web.Response(text=(decode if request.path == "/decode" else router).text())

    async def never(_: web.Request) -> web.Response:
        await hung.wait()
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/decode", metrics_of)
    app.router.add_get("/router", metrics_of)
    app.router.add_get("/hung", never)
    server = TestServer(app)
    await server.start_server()
    base = str(server.make_url("")).rstrip("/")
    c = SignalCollector(window_s=60, stale_after_s=30)
    counts = {"decode": PodCounts(ready=2)}
    try:
        async with aiohttp.ClientSession() as session:
            targets = [Target("d1", "decode", f"{base}/decode"),
                       Target("d2", "both", f"{base}/hung"),  # "both" counts as decode
                       Target("r1", "router", f"{base}/router")]
            loop = asyncio.get_running_loop()
            start = loop.time()
            got = await collect(c, session, targets, counts, 0.0, timeout_s=0.5)
            assert loop.time() - start < 3.0  # concurrently, each bounded
            # The hung pod is stale, not idle: only d1's KV usage, both queues summed.
            assert got["decode"].kv_usage == 0.5 and got["decode"].queue_depth == 3
            assert got["decode"].ready == 2
            got = await collect(c, session, targets[:1], counts, 1.0, timeout_s=0.5)
            assert got["decode"].queue_depth == 0  # the router is gone: forgotten
    finally:
        hung.set()
        await server.close()
