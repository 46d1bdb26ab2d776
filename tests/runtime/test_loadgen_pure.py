"""`cleave bench`'s pure parts: arrivals, workloads, report math, summary and progress lines."""

from __future__ import annotations

import io
import itertools
import re
import statistics
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from cleave.runtime.loadgen import plots
from cleave.runtime.loadgen.arrivals import (
    ClosedLoop,
    OpenLoop,
    arrival_offsets,
    describe,
    interarrival_gaps,
)
from cleave.runtime.loadgen.progress import Progress, render
from cleave.runtime.loadgen.record import CANCELLED, TIMEOUT, RequestRecord, http_error
from cleave.runtime.loadgen.report import (
    Slo,
    bucket_size,
    build_report,
    meets_slo,
    percentile,
    timeline,
)
from cleave.runtime.loadgen.summary import format_summary
from cleave.runtime.loadgen.workload import (
    WORDS,
    LengthDist,
    PromptsFileError,
    Workload,
    load_prompts,
    parse_length,
    parse_prompts,
)


def _gaps(schedule: OpenLoop, seed: int, n: int = 20_000) -> list[float]:
    return list(itertools.islice(interarrival_gaps(schedule, seed), n))


@pytest.mark.parametrize("shape", [1.0, 0.25])
def test_arrivals_keep_the_mean_rate(shape: float) -> None:
    gaps = _gaps(OpenLoop(rate=8.0, shape=shape), seed=3)
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.06)


def test_bursty_gaps_vary_more_than_poisson() -> None:
    poisson = _gaps(OpenLoop(8.0), seed=1)
    bursty = _gaps(OpenLoop(8.0, shape=0.25), seed=1)
    cv2 = [statistics.pvariance(g) / statistics.fmean(g) ** 2 for g in (poisson, bursty)]
    assert cv2[0] == pytest.approx(1.0, rel=0.1)  # exponential: CV² = 1
    assert cv2[1] == pytest.approx(4.0, rel=0.2)  # gamma shape k: CV² = 1/k
    # ...which shows as more uneven counts per second at the same mean rate.
    def counts(gaps: list[float]) -> list[int]:
        per_second = [0] * int(sum(gaps) + 1)
        for t in itertools.accumulate(gaps):
            per_second[int(t)] += 1
        return per_second
    assert statistics.pvariance(counts(bursty)) > 2.5 * statistics.pvariance(counts(poisson))


def test_arrivals_are_reproducible_and_increasing() -> None:
    a = list(itertools.islice(arrival_offsets(OpenLoop(5.0), seed=7), 50))
    b = list(itertools.islice(arrival_offsets(OpenLoop(5.0), seed=7), 50))
    c = list(itertools.islice(arrival_offsets(OpenLoop(5.0), seed=8), 50))
    assert a == b != c
    assert all(x < y for x, y in itertools.pairwise(a)) and a[0] > 0


@pytest.mark.parametrize("make", [lambda: OpenLoop(0), lambda: OpenLoop(-1),
                                  lambda: OpenLoop(float("inf")), lambda: OpenLoop(2, 0),
                                  lambda: ClosedLoop(0)])
def test_bad_schedules_are_refused(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="must be"):
        make()


def test_schedule_descriptions() -> None:
    assert describe(OpenLoop(4)) == "4 req/s, Poisson arrivals"
    assert "gamma shape 0.25" in describe(OpenLoop(4, 0.25))
    assert describe(ClosedLoop(3)) == "fixed concurrency 3"


@pytest.mark.parametrize(("spec", "want"), [("16", (16, 16)), ("fixed:16", (16, 16)),
                                            ("uniform:8-32", (8, 32)), (" uniform:5-5 ", (5, 5))])
def test_length_specs(spec: str, want: tuple[int, int]) -> None:
    d = parse_length(spec)
    assert (d.low, d.high) == want


@pytest.mark.parametrize("spec", ["abc", "uniform:5", "fixed:-1", "uniform:a-b", "1.5"])
def test_bad_length_specs_name_the_forms(spec: str) -> None:
    with pytest.raises(ValueError, match="uniform:A-B"):
        parse_length(spec)


@pytest.mark.parametrize("spec", ["0", "uniform:32-8", "uniform:0-4"])
def test_impossible_ranges_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="low <= high"):
        parse_length(spec)


def test_synthetic_workload() -> None:
    w = Workload(output_len=LengthDist(4, 9), prompt_len=LengthDist(10, 20), seed=5)
    reqs = [w.request(i) for i in range(400)]
    words = [len(r.prompt.split()) for r in reqs if r.prompt]
    assert words == [r.prompt_len for r in reqs]  # one token per word (tokens.py)
    assert min(words) == 10 and max(words) == 20  # both ends of the range are reachable
    assert {r.max_tokens for r in reqs} == set(range(4, 10))
    assert all(set(r.prompt.split()) <= set(WORDS) for r in reqs if r.prompt)
    assert len({r.prompt for r in reqs}) == len(reqs)  # distinct: no free prefix-cache hits
    assert w.request(17) == reqs[17]  # the same request whatever order they are built in
    assert Workload(LengthDist(4, 9), LengthDist(10, 20), seed=6).request(17) != reqs[17]


GOOD_FILE = """{"prompt": "tell me a story", "max_tokens": 5}

{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
"""


def test_prompts_file_entries_cycle_and_override_the_output_length() -> None:
    entries = parse_prompts(GOOD_FILE.splitlines(), "p.jsonl", chat=True)
    assert len(entries) == 2
    assert entries[1].messages == (("system", "be brief"), ("user", "hi"))
    w = Workload(output_len=LengthDist(7, 7), prompts=entries)
    r0, r1, r2 = (w.request(i) for i in range(3))
    assert (r0.prompt, r0.max_tokens) == ("tell me a story", 5)
    assert (r1.messages, r1.max_tokens) == (entries[1].messages, 7)
    assert r2.prompt == r0.prompt


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "x"', "p.jsonl:2: not valid JSON"),
    ('["x"]', "p.jsonl:2: expected a JSON object, got list"),
    ('{"text": "x"}', "p.jsonl:2: needs exactly one of 'prompt'"),
    ('{"prompt": "x", "messages": []}', "p.jsonl:2: needs exactly one of"),
    ('{"prompt": ""}', "p.jsonl:2: 'prompt' must be a non-empty string"),
    ('{"prompt": 5}', "p.jsonl:2: 'prompt' must be a non-empty string"),
    ('{"prompt": "x", "max_tokens": 0}', "p.jsonl:2: 'max_tokens' must be a positive integer"),
    ('{"prompt": "x", "max_tokens": true}', "'max_tokens' must be a positive integer"),
    ('{"prompt": "x", "max_tokens": "5"}', "'max_tokens' must be a positive integer"),
    ('{"messages": [{"role": "user"}]}', "p.jsonl:2: messages\\[0\\] must be an object"),
    ('{"messages": "hi"}', "'messages' must be a non-empty list"),
])
def test_bad_prompt_lines_are_named(line: str, message: str) -> None:
    with pytest.raises(PromptsFileError, match=message):
        parse_prompts(['{"prompt": "fine"}', line], "p.jsonl", chat=True)


def test_messages_need_the_chat_endpoint_and_files_need_prompts(tmp_path: Path) -> None:
    needs_chat = re.escape("p.jsonl:3: 'messages' needs --endpoint chat")
    with pytest.raises(PromptsFileError, match=needs_chat):
        parse_prompts(GOOD_FILE.splitlines(), "p.jsonl", chat=False)
    with pytest.raises(PromptsFileError, match="no prompts"):
        parse_prompts(["", "  "], "p.jsonl", chat=False)
    with pytest.raises(PromptsFileError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl", chat=False)
    f = tmp_path / "ok.jsonl"
    f.write_text(GOOD_FILE)
    assert len(load_prompts(f, chat=True)) == 2


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    assert percentile([0.0, 10.0], 0) == 0.0 and percentile([0.0, 10.0], 100) == 10.0


def _records() -> list[RequestRecord]:
    return [
        # 11 tokens: TPOT = (1.1 - 0.1) / 10 = 0.1 s; chunk gaps 0.1 and 0.2
        RequestRecord(0, start=0.0, e2e=1.1, ttft=0.1, chunk_times=(0.1, 0.2, 0.4),
                      prompt_tokens=20, output_tokens=11, usage_reported=True),
        # one token: no TPOT, no ITL
        RequestRecord(1, start=0.5, e2e=0.5, ttft=0.5, chunk_times=(0.5,),
                      prompt_tokens=30, output_tokens=1, usage_reported=True),
        RequestRecord(2, start=1.0, e2e=0.2, error=http_error(500), error_detail="boom"),
        RequestRecord(3, start=1.5, e2e=2.0, error=TIMEOUT, error_detail="slow"),
        RequestRecord(4, start=1.6, e2e=0.1, error=http_error(500), error_detail="boom"),
        RequestRecord(5, start=1.7, e2e=0.3, error=CANCELLED),
    ]


def test_report_math() -> None:
    recs = _records()
    assert recs[0].tpot == pytest.approx(0.1) and recs[1].tpot is None
    assert recs[0].itls == pytest.approx((0.1, 0.2))
    rep = build_report(recs, duration=4.0, slo=Slo(ttft=0.2), config={})
    assert rep["requests"] == {"sent": 6, "completed": 2, "failed": 3, "cancelled": 1,
                               "without_usage": 0}
    assert rep["tokens"] == {"prompt": 50, "output": 12}
    assert rep["throughput"]["requests_per_s"] == pytest.approx(0.5)
    assert rep["throughput"]["output_tokens_per_s"] == pytest.approx(3.0)
    assert rep["throughput"]["total_tokens_per_s"] == pytest.approx(62 / 4)
    lat = rep["latency_ms"]
    assert lat["ttft"]["count"] == 2 and lat["ttft"]["p50"] == pytest.approx(300.0)
    assert lat["tpot"]["count"] == 1 and lat["tpot"]["max"] == pytest.approx(100.0)
    assert lat["itl"]["count"] == 2 and lat["itl"]["mean"] == pytest.approx(150.0)
    assert lat["e2e"]["p99"] == pytest.approx(500 + 600 * 0.99)
    # Only request 0 has TTFT <= 200 ms; failed requests are never good.
    assert rep["goodput"] == {"requests_per_s": 0.25, "good_requests": 1, "attainment": 0.2}
    assert rep["slo"] == {"ttft_ms": pytest.approx(200.0), "tpot_ms": None}
    assert rep["errors"] == {"http_500": {"count": 2, "examples": ["boom"]},
                             "timeout": {"count": 1, "examples": ["slow"]}}
    assert [r["index"] for r in rep["per_request"]] == [0, 1, 2, 3, 4, 5]


def test_goodput_needs_both_objectives() -> None:
    ok, one_token = _records()[:2]
    assert meets_slo(ok, Slo(tpot=0.1)) and not meets_slo(ok, Slo(tpot=0.09))
    assert meets_slo(one_token, Slo(tpot=0.001))  # one token: no TPOT to miss
    assert not meets_slo(ok, Slo(ttft=1.0, tpot=0.05))
    assert build_report(_records(), 4.0, Slo(), {})["goodput"] is None


def test_timeline_accounts_for_every_request_and_token() -> None:
    recs = _records()
    rows = timeline(recs, duration=4.0)
    width = bucket_size(4.0)
    assert rows[1]["t_s"] == pytest.approx(width)
    assert sum(r["sent_per_s"] for r in rows) * width == pytest.approx(5)  # not the cancelled
    assert sum(r["completed_per_s"] for r in rows) * width == pytest.approx(2)
    assert sum(r["failed_per_s"] for r in rows) * width == pytest.approx(3)
    assert sum(r["output_tokens_per_s"] for r in rows) * width == pytest.approx(12)
    # Mean requests in flight: request-seconds per bucket (the cancelled one does not count).
    total = sum(r["mean_in_flight"] for r in rows) * width
    assert total == pytest.approx(1.1 + 0.5 + 0.2 + 2.0 + 0.1)
    at = {round(r["t_s"], 6): r["mean_in_flight"] for r in rows}
    assert at[0.9] == pytest.approx(2.0)  # requests 0 and 1 throughout [0.9, 1.0)
    assert at[1.0] == pytest.approx(2.0)  # 0 until 1.1, 2 from 1.0
    assert at[1.1] == pytest.approx(1.0)  # only 2, until 1.2
    assert bucket_size(0.5) == 0.1 and bucket_size(100) == 2 and bucket_size(3600) == 120


def test_summary_shows_the_figures() -> None:
    config = {"endpoint_url": "http://x/v1/completions", "model": "m", "load": "l",
              "workload": "w"}
    rep = build_report(_records(), 4.0, Slo(ttft=0.2, tpot=0.15), config, interrupted=True)
    text = format_summary(rep)
    assert "INTERRUPTED" in text and "1 cancelled" in text
    assert "0.25 req/s (20% of requests within TTFT <= 200 ms and TPOT <= 150 ms)" in text
    ttft_row = next(line for line in text.splitlines() if line.startswith("TTFT"))
    assert ttft_row.split()[1:3] == ["300.0", "300.0"]  # mean and p50
    assert any(line.split()[:2] == ["http_500", "2"] for line in text.splitlines())
    empty = format_summary(build_report([], 1.0, Slo(), config))
    assert "(no data)" in empty


def test_progress_lines() -> None:
    line = render(sent=12, done=9, failed=1, elapsed=5.0, total=20, duration=None, bar=True)
    assert line.startswith("[" + "#" * 14 + "." * 14 + "]") and "10/20 done" in line
    assert "failed 1" in line and "2.00 req/s" in line and "00:05" in line
    by_time = render(3, 3, 0, elapsed=30.0, total=None, duration=60.0, bar=False)
    assert by_time.startswith(" 50%") and "[" not in by_time
    # A --duration run ends with its last request, maybe just short of the duration.
    assert render(3, 3, 0, 59.5, None, 60.0, bar=False, complete=True).startswith("100%")
    out = io.StringIO()
    p = Progress(total=2, duration=None, stream=out, tty=False)
    p.on_sent()
    p.on_finished(ok=False)
    p.draw(final=True)
    assert "\r" not in out.getvalue() and "failed 1" in out.getvalue()
    tty = io.StringIO()
    Progress(total=2, duration=None, stream=tty, tty=True).draw()
    assert tty.getvalue().startswith("\r[")


def test_cdf_plot_marks_the_percentiles_the_report_gives() -> None:
    """The dashed lines of latency_cdf.png sit where report.json's p50 and p99 are."""
    values = [i / 1000.0 for i in range(1, 11)]  # 1..10 ms
    ax = Figure().subplots()
    plots._cdf(ax, "TTFT", values, slo_ms=7.0)
    marks = {line.get_label(): float(line.get_xdata()[0]) for line in ax.lines
             if line.get_label() in ("p50", "p99", "SLO")}
    assert marks == {"p50": pytest.approx(5.5), "p99": pytest.approx(9.91), "SLO": 7.0}
    assert marks["p99"] == pytest.approx(percentile(sorted(v * 1000 for v in values), 99))
