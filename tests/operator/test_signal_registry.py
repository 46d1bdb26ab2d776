"""One signal registry, two sources: the pod scraper and the Prometheus source give the same
signals, field for field, for the same series.

Fake workers export their metrics through prometheus-client under the runtime's names, as a
real worker does; every scrape's text is fed to the operator's ``SignalCollector`` and, with
its timestamp, backfilled into a real Prometheus (``promtool tsdb create-blocks-from
openmetrics``), which then answers the Prometheus source's exact PromQL at the last scrape's
time. A window's first sample sits on the range's start, so ``rate()`` extrapolates nothing
(Prometheus 2, Debian's, closes ranges on the left; a Prometheus 3 would extrapolate over
the first interval, and agree only on series linear in time).
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from charts.prometheus_support import PROMETHEUS, prometheus
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cleave.autoscaling import registry
from cleave.autoscaling.policy import DECODE, PREFILL, RoleSignals
from cleave.autoscaling.signals import ROUTER, SignalCollector, parse_metrics
from cleave.common import metric_names as names
from cleave.operator.autoscaler import prometheus as source

pytestmark = pytest.mark.skipif(PROMETHEUS is None,
                                reason="needs Debian's prometheus package: `make prometheus`")
STEP_S, WINDOW_S, STEPS = 5.0, 30.0, 13
NS, NAME = "ml", "chat"


class FakePod:
    """One process's metrics, registered under the runtime's names and label."""

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(names.TTFT, "ttft", ["role"], buckets=names.LATENCY_BUCKETS,
                              registry=r).labels(role)
        self.tpot = Histogram(names.TPOT, "tpot", ["role"], buckets=names.TPOT_BUCKETS,
                              registry=r).labels(role)
        self.waiting = Gauge(names.WAITING, "waiting", ["role"], registry=r).labels(role)
        self.kv = Gauge(names.KV_USAGE, "kv", ["role"], registry=r).labels(role)
        self.prompt = Counter(names.PROMPT_TOKENS, "p", ["role"], registry=r).labels(role)
        self.generated = Counter(names.GENERATION_TOKENS, "g", ["role"], registry=r).labels(role)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def _step(pods: dict[str, FakePod], k: int) -> None:
    """What happened in the k-th interval: constant rates per pod, queues that come and go."""
    pre, d1, d2, router = (pods[n] for n in ("pre-1", "dec-1", "dec-2", "router-1"))
    for ttft in (0.03, 0.3, 0.7, 2.0):
        pre.ttft.observe(ttft)
    pre.prompt.inc(300 * STEP_S)
    pre.waiting.set(2 if k % 3 else 0)
    # dec-1 runs faster while nothing waits: a queue condition lost would read its 60 tok/s.
    for pod, tpot, rate in ((d1, 0.02, 40.0 if k in (9, 10) else 60.0), (d2, 0.09, 25.0)):
        for _ in range(3):
            pod.tpot.observe(tpot)
        pod.generated.inc(rate * STEP_S)
    # dec-1 is saturated only between its 9th and 11th scrapes (inside the window); dec-2
    # always: the best saturated pair is dec-1's 40 tok/s.
    d1.waiting.set(1 if 8 <= k <= 10 else 0)
    d2.waiting.set(3)
    d1.kv.set(0.5 + 0.01 * k)
    d2.kv.set(0.3)
    router.waiting.set(k % 2)


def _openmetrics(scrapes: list[tuple[float, FakePod, str]]) -> str:
    """The scrapes as OpenMetrics with timestamps, labelled as the ServiceMonitor labels
    series: families whole, each series' points in time order."""
    families: dict[str, tuple[str, dict[str, list[str]]]] = {}
    for at, pod, text in scrapes:
        for family in text_string_to_metric_families(text):
            _, series = families.setdefault(family.name, (family.type, {}))
            point: list[str] = []
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                labels = {**s.labels, "namespace": NS, "llmservice": NAME,
                          "instance": pod.name}
                shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                point.append(f"{s.name}{{{shown}}} {s.value} {at:.3f}")
            series.setdefault(pod.name, []).extend(point)
    out = []
    for name, (kind, series) in families.items():
        out.append(f"# TYPE {name} {kind}")
        out += [line for lines in series.values() for line in lines]
    return "\n".join([*out, "# EOF", ""])


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, float,
                                                                        SignalCollector]]:
    pods = {n: FakePod(n, r) for n, r in (("pre-1", PREFILL), ("dec-1", DECODE),
                                          ("dec-2", DECODE), ("router-1", ROUTER))}
    collector = SignalCollector(WINDOW_S, stale_after_s=2 * STEP_S)
    start = (time.time() // 3600 - 1) * 3600  # an hour back, on whole steps
    scrapes = []
    for k in range(STEPS):
        _step(pods, k)
        at = start + k * STEP_S
        for pod in pods.values():
            text = pod.text()
            collector.record(pod.name, pod.role, at, parse_metrics(text))
            scrapes.append((at, pod, text))
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "series.om").write_text(_openmetrics(scrapes))
    subprocess.run([str(Path(str(PROMETHEUS)).with_name("promtool")), "tsdb",
                    "create-blocks-from", "openmetrics", str(workdir / "series.om"),
                    str(workdir / "data")], check=True, capture_output=True)
    with prometheus(workdir, [], []) as prom:
        yield prom.url, start + (STEPS - 1) * STEP_S, collector


@pytest.mark.parametrize("role", [PREFILL, DECODE])
async def test_both_sources_give_the_same_signals(
        scraped: tuple[str, float, SignalCollector], role: str) -> None:
    url, now, collector = scraped
    counts = {"ready": 2, "starting": 1, "pending": 0}
    by_pods = collector.role_signals(role, now, **counts)
    async with aiohttp.ClientSession() as session:
        by_prometheus = await source.role_signals(
            session, url, NS, NAME, role, WINDOW_S, scrape_s=STEP_S, at=now, **counts)
    assert by_prometheus is not None
    for field in dataclasses.fields(RoleSignals):
        pods_v, prom_v = getattr(by_pods, field.name), getattr(by_prometheus, field.name)
        assert (prom_v is None) == (pods_v is None), (field.name, by_pods, by_prometheus)
        if pods_v is not None:
            assert prom_v == pytest.approx(pods_v, rel=1e-6), (field.name, by_pods,
                                                               by_prometheus)
    # Every signal the registry defines for the role has a value here: nothing compared
    # None with None.
    present = {s.key for s in registry.for_role(role)} - {"queue_role", "queue_router"}
    assert all(getattr(by_pods, k) is not None for k in present), by_pods
    if role == DECODE:
        assert by_pods.throughput_per_replica == pytest.approx(40.0)  # dec-1's pair, not 25
        assert by_pods.kv_usage == pytest.approx((0.62 + 0.3) / 2)
        assert by_pods.token_rate == pytest.approx((4 * 60 + 2 * 40) / 6 + 25)
    else:
        assert by_pods.request_rate == pytest.approx(4 / STEP_S)
        assert by_pods.token_rate == pytest.approx(300.0)
