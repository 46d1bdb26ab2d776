"""The optional Prometheus source of autoscaler signals, against a stand-in Prometheus."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cleave.autoscaling.policy import RoleSignals
from cleave.common import metric_names as names
from cleave.operator.autoscaler import prometheus

# --- Prometheus source --------------------------------------------------------------------


def test_promql_per_role() -> None:
    q = prometheus.queries("ml", "chat", "prefill", 60)
    # A worker serving both roles (the one-worker floor) counts for each, as scraped.
    sel = 'namespace="ml", llmservice="chat", role=~"prefill|both"'
    assert q["latency_p90"] == ("histogram_quantile(0.9, sum by (le) (rate("
                                f"{names.bucket(names.TTFT)}{{{sel}}}[60s])))")
    assert q["token_rate"] == f"sum(rate({names.total(names.PROMPT_TOKENS)}{{{sel}}}[60s]))"
    assert q["queue_router"] == \
        f'sum({names.WAITING}{{namespace="ml", llmservice="chat", role="router"}})'
    assert "kv_usage" not in q
    # The backlog rules' inputs (issue 18: the Prometheus path used to leave them unset).
    assert q["request_rate"] == f"sum(rate({names.TTFT}_count{{{sel}}}[60s]))"
    assert "irate(" + names.total(names.PROMPT_TOKENS) in q["throughput_per_replica"]
    assert "[60s:15000ms]" in q["throughput_per_replica"]
    d = prometheus.queries("ml", "chat", "decode", 30)
    assert names.bucket(names.TPOT) in d["latency_p90"]
    assert 'role=~"decode|both"' in d["kv_usage"] and "[30s]" in d["token_rate"]
    assert "request_rate" not in d and "throughput_per_replica" in d


def vector(*values: str) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {}, "value": [1700000000.0, v]} for v in values]}}


def test_scalar_of_an_answer() -> None:
    assert prometheus.scalar(vector("0.25")) == 0.25
    assert prometheus.scalar(vector()) is None  # no series: nothing scraped recently
    assert prometheus.scalar(vector("NaN")) is None  # no observations in the window
    with pytest.raises(prometheus.PrometheusError):
        prometheus.scalar({"status": "error", "error": "parse error"})


@pytest.fixture()
async def fake_prometheus() -> AsyncIterator[tuple[str, dict[str, dict[str, Any]]]]:
    """A real HTTP server answering /api/v1/query from a table keyed by the query's metric."""
    table: dict[str, dict[str, Any]] = {}

    async def query(request: web.Request) -> web.Response:
        q = request.query["query"]
        if "fail" in table:
            return web.Response(status=503)
        for key, answer in table.items():
            if key in q:
                return web.json_response(answer)
        return web.json_response(vector())

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    server = TestServer(app)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), table
    await server.close()


async def test_role_signals_from_prometheus(
        fake_prometheus: tuple[str, dict[str, dict[str, Any]]]) -> None:
    url, table = fake_prometheus
    table.update({"time_per_output_token": vector("0.08"), "generation_tokens": vector("420"),
                  "kv_cache_usage": vector("0.7"), 'role="router"': vector("2"),
                  "num_requests_waiting": vector("5")})
    async with aiohttp.ClientSession() as session:
        got = await prometheus.role_signals(session, url, "ml", "chat", "decode", 60,
                                            ready=2, starting=1, pending=0)
        # (The stand-in answers by substring: the throughput query reads the tokens too.)
        assert got == RoleSignals(latency_p90=0.08, kv_usage=0.7, queue_depth=7.0,
                                  token_rate=420.0, throughput_per_replica=420.0, ready=2,
                                  starting=1, pending=0)
        # At zero only the router's held requests exist: that demand is the signal.
        table.clear()
        table['role="router"'] = vector("3")
        woken = await prometheus.role_signals(session, url, "ml", "chat", "prefill", 60,
                                              ready=0, starting=0, pending=0)
        assert woken is not None and (woken.queue_depth, woken.token_rate) == (3.0, 0.0)
        # Replicas exist but no series: unknown, never zero.
        table.clear()
        unknown = await prometheus.role_signals(session, url, "ml", "chat", "prefill", 60,
                                                ready=1, starting=0, pending=0)
        assert unknown == RoleSignals(ready=1)
        table["fail"] = {}
        assert await prometheus.role_signals(session, url, "ml", "chat", "prefill", 60,
                                             ready=1, starting=0, pending=0) is None
        assert await prometheus.role_signals(session, "http://127.0.0.1:9", "ml", "chat",
                                             "prefill", 60, ready=1, starting=0, pending=0,
                                             timeout_s=1.0) is None
