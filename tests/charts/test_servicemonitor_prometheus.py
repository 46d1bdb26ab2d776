"""The chart's ServiceMonitor, the operator's labels and the queries that read the series,
checked against one another by a real Prometheus (issue 19).

The autoscaler's Prometheus source and the chart's Grafana dashboard select series by labels
(``namespace``, ``llmservice``, ``role``) that only exist if the ServiceMonitor selects the
Services the operator builds, on the port name they have, and relabels what the queries
expect. A fake that matches queries by substring cannot see any of that; Prometheus can. It
scrapes real router and worker processes serving real requests, configured from the rendered
chart's ServiceMonitor as the Prometheus Operator would (``prometheus_support``), and the
exact PromQL of the autoscaler and of every dashboard panel is evaluated by it.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from chart_support import ALL_ON, HELM, by_kind, template
from prometheus_support import PROMETHEUS, Obj, Prometheus, prometheus, scrape_config, targets
from serving_stack import SERVED, start_stack

from cleave.autoscaling.policy import DECODE, PREFILL
from cleave.common import metric_names as names
from cleave.operator.autoscaler.prometheus import queries, scalar
from cleave.operator.builders import desired_children, owner_reference
from cleave.operator.redis_users import RedisPasswords
from cleave.operator.spec import parse_spec

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or not HELM.is_file(),
    reason="needs helm and Debian's prometheus package: run `make setup prometheus`")

NS, NAME = "ml", "chat"
SERVICE: Obj = {"apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
                "metadata": {"name": NAME, "namespace": NS, "uid": "u-1"},
                "spec": {"model": {"name": "tiny", "source": "smollm2-135m-instruct"},
                         "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                         "kvStore": {"managed": {"memory": "1Gi"}}}}
WINDOW_S = 30
# Panels fed by other exporters: kube-state-metrics, and the operator's own PodMonitor.
ELSEWHERE = ("kube_deployment_status_replicas_ready", names.AUTOSCALER_DESIRED)
LONG = "the quick brown fox jumps over the lazy dog " * 8  # disaggregated: prefill + decode
SHORT = "hello there"


def _load(base_url: str, seconds: float) -> None:
    """Requests for ``seconds``; each long prompt new (a repeated one would find its KV in
    the store and need no prefill worker)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + seconds
    for i in itertools.count():
        if time.monotonic() > deadline:
            return
        for prompt in (f"{i} {LONG}", SHORT):
            client.completions.create(model=SERVED, prompt=prompt, max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def scraped(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[tuple[Prometheus, Obj]]:
    docs = template(ALL_ON, tmp_path=tmp_path_factory.mktemp("values"))
    [monitor] = by_kind(docs, "ServiceMonitor")
    [dashboard] = [json.loads(raw) for cm in by_kind(docs, "ConfigMap")
                   if cm["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
                   for raw in cm["data"].values()]
    children = desired_children(parse_spec(SERVICE), owner_reference(SERVICE),
                                RedisPasswords("adm", "wpw", "rpw"),
                                {"prefill": 1, "decode": 1, "router": 1}, "salt",
                                internal_token="tok")
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("prom-logs"))
    try:
        workers = {w.name.split("-")[0]: w.url for w in stack.workers}
        assert stack.router is not None
        addresses = {role: url.removeprefix("http://") for role, url in
                     {**workers, "router": stack.router.url}.items()}
        workdir = tmp_path_factory.mktemp("prometheus")
        with prometheus(workdir, scrape_config(monitor), targets(children, addresses)) as prom:
            deadline = time.monotonic() + 60
            while not _all_up(prom) and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(2)  # scrapes before the traffic: rate() needs a sample to start from
            _load(stack.base_url, 8.0)
            time.sleep(3)  # scrapes after the last request
            yield prom, dashboard
    finally:
        stack.stop()


def _all_up(prom: Prometheus) -> bool:
    active = prom.active_targets()
    return bool(active) and all(t["health"] == "up" for t in active)


def test_servicemonitor_selects_the_services_the_operator_builds(
        scraped: tuple[Prometheus, Obj]) -> None:
    """Exactly the router, prefill and decode Services are scraped (not the managed Redis),
    each healthy and labelled as the queries select series."""
    prom, _ = scraped
    active = prom.active_targets()
    assert {t["labels"]["service"] for t in active} == {f"{NAME}-{c}" for c in
                                                        ("router", "prefill", "decode")}
    assert all(t["health"] == "up" for t in active), [t["lastError"] for t in active]
    for t in active:
        assert (t["labels"]["namespace"], t["labels"]["llmservice"]) == (NS, NAME), t["labels"]
    dropped = prom.api("targets", state="dropped")["data"]["droppedTargets"]
    assert any(d["discoveredLabels"]["__meta_kubernetes_service_name"] == f"{NAME}-redis"
               for d in dropped)


@pytest.mark.parametrize("role", [PREFILL, DECODE])
def test_autoscaler_queries_find_their_series(scraped: tuple[Prometheus, Obj],
                                              role: str) -> None:
    """Every signal of the autoscaler's Prometheus source, as it asks for it, has a value;
    the rates and latencies of the traffic just served are positive."""
    prom, _ = scraped
    values = {key: scalar(prom.api("query", query=promql))
              for key, promql in queries(NS, NAME, role, WINDOW_S).items()}
    # The saturated throughput exists only while a queue stands, which this light load
    # need not cause; its query must still be one Prometheus evaluates (scalar() raises else).
    assert None not in [v for k, v in values.items() if k != "throughput_per_replica"], values
    assert values["token_rate"] > 0 and values["latency_p90"] > 0, values


def _panel_queries(dashboard: Obj) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return [e.replace("$namespace", NS).replace("$llmservice", NAME)
            .replace("$__rate_interval", f"{WINDOW_S}s") for e in exprs]


def test_dashboard_panels_and_variables_find_their_series(
        scraped: tuple[Prometheus, Obj]) -> None:
    """The dashboard's variables list this service, and every panel fed by Cleave's own
    series returns data for it (a panel with a misnamed metric or label shows nothing)."""
    prom, dashboard = scraped
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = variable["definition"].removeprefix("label_values(").rsplit(",", 1)
        series = match[0].replace("$namespace", NS)
        label = match[1].strip(" )")
        values = prom.api(f"label/{label}/values", **{"match[]": series})["data"]
        assert {"namespace": NS, "llmservice": NAME}[label] in values, (variable, values)
    empty: list[Any] = []
    for expr in _panel_queries(dashboard):
        if not any(name in expr for name in ELSEWHERE) and not prom.vector(expr):
            empty.append(expr)
    assert not empty, "panels with no data:\n" + "\n".join(empty)
