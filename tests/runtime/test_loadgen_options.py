"""`cleave bench`'s options and units, the shared-prefix and warm-up workloads, vLLM's result
keys and the KV-store figures read from /metrics (pure parts; the HTTP parts are in
test_loadgen_client.py and test_loadgen_e2e.py)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from cleave.common import metric_names as names
from cleave.runtime.loadgen.arrivals import ClosedLoop, OpenLoop, describe
from cleave.runtime.loadgen.cli import add_bench_parser
from cleave.runtime.loadgen.options import parse_seconds, settings_from_args
from cleave.runtime.loadgen.record import RequestRecord
from cleave.runtime.loadgen.report import Slo, build_report
from cleave.runtime.loadgen.server_metrics import Counters, figures, parse
from cleave.runtime.loadgen.vllm_result import vllm_result
from cleave.runtime.loadgen.workload import LengthDist, SharedPrefix, Workload


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


@pytest.mark.parametrize(("text", "seconds"), [
    ("0.5", 0.5), ("2", 2.0), ("0.5s", 0.5), ("500ms", 0.5), (" 50 ms ", 0.05), ("1e-1", 0.1),
    (".25", 0.25)])
def test_durations_are_seconds_unless_written_in_ms(text: str, seconds: float) -> None:
    value, warning = parse_seconds("--ttft-slo", text)
    assert value == pytest.approx(seconds) and warning is None


@pytest.mark.parametrize(("text", "message"), [
    ("fast", "takes seconds"), ("-1", "takes seconds"), ("0", "must be positive"),
    ("0ms", "must be positive"), ("5 min", "takes seconds")])
def test_bad_durations_name_the_forms(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_seconds("--ttft-slo", text)


def test_an_old_millisecond_value_warns() -> None:
    value, warning = parse_seconds("--ttft-slo", "500")
    assert value == 500.0  # seconds, as the option now says
    assert warning is not None and "write 500ms for milliseconds" in warning


def test_slos_reach_the_settings_in_seconds() -> None:
    s = settings_from_args(_args("--ttft-slo", "500ms", "--tpot-slo", "0.05"))
    assert s.slo == Slo(ttft=0.5, tpot=0.05) and s.warnings == ()
    assert settings_from_args(_args("--ttft-slo", "800")).warnings  # surely meant ms


def test_rate_with_a_concurrency_cap() -> None:
    s = settings_from_args(_args("--rate", "4", "--max-concurrency", "3"))
    assert s.schedule == OpenLoop(4.0, 1.0, max_concurrency=3)
    assert describe(s.schedule) == "4 req/s, Poisson arrivals, at most 3 in flight"
    assert settings_from_args(_args("--concurrency", "5")).schedule == ClosedLoop(5)
    assert settings_from_args(_args("--request-rate", "2")).schedule == OpenLoop(2.0)


@pytest.mark.parametrize(("argv", "message"), [
    (["--rate", "2", "--concurrency", "0"], "concurrency must be at least 1"),
    (["--concurrency", "0"], "concurrency must be at least 1"),
    (["--shared-prefix", "0"], "at least 1"),
    (["--shared-prefix", "2", "--prefix-len", "0"], "at least 1 token"),
    (["--shared-prefix", "2", "--prompt-len", "64"], "give the suffix with --suffix-len"),
    (["--prefix-len", "64"], "need --shared-prefix"),
    (["--suffix-len", "64"], "need --shared-prefix"),
    (["--shared-prefix", "2", "--suffix-len", "uniform:9-3"], "low <= high"),
    (["--num-warmups", "-1"], "--num-warmups must be 0 or more"),
    (["--ttft-slo", "soon"], "--ttft-slo takes seconds"),
    (["--tpot-slo", "0"], "--tpot-slo must be positive"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_bad_options_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings_from_args(_args(*argv))


def test_shared_prefix_settings() -> None:
    s = settings_from_args(_args("--shared-prefix", "4", "--suffix-len", "32",
                                 "--num-warmups", "2"))
    assert s.workload.shared == SharedPrefix(4, 256)  # vLLM's default prefix length
    assert s.workload.prompt_len == LengthDist(32, 32) and s.warmups == 2
    assert s.workload.describe() == ("4 shared prefixes of 256 tokens + suffixes of fixed:32 "
                                     "tokens, output fixed:64 tokens")


def test_shared_prefix_prompts_share_exactly_n_prefixes() -> None:
    w = Workload(LengthDist(8, 8), LengthDist(5, 9), seed=3, shared=SharedPrefix(3, 20))
    reqs = [w.request(i) for i in range(30)]
    heads = [" ".join(r.prompt.split()[:20]) for r in reqs if r.prompt]
    assert len(set(heads)) == 3  # N distinct prefixes ...
    assert all(heads[i] == w.prefix(i % 3) for i in range(30))  # ... used round-robin
    assert [r.prefix for r in reqs] == [i % 3 for i in range(30)]
    tails = [" ".join(r.prompt.split()[20:]) for r in reqs if r.prompt]
    assert len(set(tails)) == 30  # every request has a suffix of its own
    assert all(r.prompt_len == len(r.prompt.split()) and 25 <= r.prompt_len <= 29
               for r in reqs if r.prompt)
    assert w.request(7) == reqs[7]  # reproducible in any order


def test_warm_up_prompts_have_the_lengths_but_not_the_prefixes() -> None:
    w = Workload(LengthDist(8, 8), LengthDist(6, 6), seed=3, shared=SharedPrefix(2, 10))
    warm = [w.warmup(i) for i in range(4)]
    measured_heads = {w.prefix(0), w.prefix(1)}
    for r in warm:
        assert r.prompt is not None and r.prompt_len == 16 == len(r.prompt.split())
        assert " ".join(r.prompt.split()[:10]) not in measured_heads
    plain = Workload(LengthDist(8, 8), LengthDist(6, 6), seed=3)
    assert {plain.warmup(i).prompt for i in range(4)}.isdisjoint(
        {plain.request(i).prompt for i in range(50)})


def _report() -> dict[str, Any]:
    recs = [RequestRecord(0, start=0.0, e2e=1.1, ttft=0.1, chunk_times=(0.1, 0.2, 0.4),
                          prompt_tokens=20, output_tokens=11, usage_reported=True),
            RequestRecord(1, start=0.5, e2e=0.5, ttft=0.3, chunk_times=(0.3, 0.5),
                          prompt_tokens=30, output_tokens=2, usage_reported=True),
            RequestRecord(2, start=2.0, e2e=0.2, error="http_500")]
    config = {"endpoint": "chat", "model": "m", "rate": None, "gamma_shape": None,
              "concurrency": 2, "started_at": "2026-01-01T00:00:00Z"}
    return build_report(recs, 4.0, Slo(ttft=0.2), config)


def test_vllm_result_keys_and_values() -> None:
    rep = _report()
    v = vllm_result(rep)
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99"):
            assert isinstance(v[f"{stat}_{m}_ms"], float), (stat, m)
    assert (v["completed"], v["failed"], v["num_prompts"]) == (2, 1, 3)
    assert (v["total_input_tokens"], v["total_output_tokens"]) == (50, 13)
    assert v["request_throughput"] == pytest.approx(0.5)
    assert v["output_throughput"] == pytest.approx(13 / 4)
    assert v["total_token_throughput"] == pytest.approx(63 / 4)
    assert v["request_goodput"] == pytest.approx(0.25)  # only request 0 within 200 ms
    assert v["median_ttft_ms"] == pytest.approx(200.0) and v["std_ttft_ms"] == pytest.approx(100)
    assert v["mean_e2el_ms"] == pytest.approx(800.0)
    assert v["max_concurrent_requests"] == 2  # requests 0 and 1 overlap; 2 starts after
    assert (v["backend"], v["request_rate"], v["max_concurrency"]) == ("openai-chat", "inf", 2)


METRICS_PAGE = f"""# TYPE {names.STORE_HITS} counter
{names.total(names.STORE_HITS)} 40.0
# TYPE {names.STORE_MISSES} counter
{names.total(names.STORE_MISSES)} 2.0
# TYPE {names.KV_LOADED_BLOCKS} counter
{names.total(names.KV_LOADED_BLOCKS)}{{purpose="prefix"}} 25.0
{names.total(names.KV_LOADED_BLOCKS)}{{purpose="decode"}} 15.0
# TYPE {names.PROMPT_TOKENS} counter
{names.total(names.PROMPT_TOKENS)}{{role="prefill"}} 999.0
# TYPE {names.ROUTING_DECISIONS} counter
{names.total(names.ROUTING_DECISIONS)}{{path="decode_only",reason="prefill_backlog"}} 4.0
{names.total(names.ROUTING_DECISIONS)}{{path="decode_only",reason="short_prompt"}} 1.0
{names.total(names.ROUTING_DECISIONS)}{{path="disaggregated",reason="long_prompt"}} 7.0
"""


def test_kv_store_figures_from_metrics_pages() -> None:
    after = parse(METRICS_PAGE)
    assert after == Counters(store_hits=40, store_misses=2, handoff_blocks=15,
                             routes=(("decode_only", 5.0), ("disaggregated", 7.0)))
    before = Counters(store_hits=10, store_misses=2, handoff_blocks=5,
                      routes=(("disaggregated", 7.0),))
    f = figures(before, after, prompt_tokens=800, workers=2, block_size=16)
    # 30 blocks read, 10 of them the decode side's handoff: 20 prefix blocks = 320 tokens.
    assert f["kv_store_prefix_blocks"] == 20 and f["kv_store_handoff_blocks"] == 10
    assert f["kv_store_hit_rate"] == pytest.approx(320 / 800)
    assert f["kv_store_block_hit_ratio"] == 1.0 and f["kv_store_block_misses"] == 0
    assert f["routing"] == {"decode_only": 5}  # the run's requests, by the router's path
    # A worker restarted mid-run: its counters went back to 0, nothing negative is reported.
    restarted = figures(after, Counters(), prompt_tokens=800, workers=2)
    assert restarted["kv_store_hit_rate"] == 0.0 and restarted["kv_store_block_hits"] == 0
    assert figures(before, after, prompt_tokens=0, workers=1)["kv_store_hit_rate"] is None
