"""Figures from the request records: latency percentiles, throughput, goodput, errors.

Pure functions of the records; latencies are reported in milliseconds. Only successful requests
count towards latencies and throughput; interrupted ones (``cancelled``) count nowhere.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cleave.runtime.loadgen.record import CANCELLED, RequestRecord

PERCENTILES = (50, 90, 95, 99)
MAX_ERROR_EXAMPLES = 3


@dataclass(frozen=True)
class Slo:
    """Latency objectives in seconds; None: that one is not checked."""

    ttft: float | None = None
    tpot: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft is not None or self.tpot is not None


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values_s: Iterable[float]) -> dict[str, float] | None:
    """count, mean, std, min, p50..p99, max in milliseconds; None when there are no values.
    ``std`` is the population standard deviation (numpy's default, as vLLM reports it)."""
    ms = sorted(v * 1000.0 for v in values_s)
    if not ms:
        return None
    mean = sum(ms) / len(ms)
    out = {"count": float(len(ms)), "mean": mean,
           "std": math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)), "min": ms[0]}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    out["max"] = ms[-1]
    return out


def meets_slo(r: RequestRecord, slo: Slo) -> bool:
    """Successful and within both objectives; a one-token answer has no TPOT to miss."""
    if not r.ok or r.ttft is None:
        return False
    if slo.ttft is not None and r.ttft > slo.ttft:
        return False
    tpot = r.tpot
    return slo.tpot is None or tpot is None or tpot <= slo.tpot


def errors_by_type(records: Iterable[RequestRecord]) -> dict[str, dict[str, Any]]:
    """``{class: {count, examples}}``, most frequent first; examples are distinct details."""
    failed = [r for r in records if r.error is not None and r.error != CANCELLED]
    counts = Counter(r.error for r in failed)
    out: dict[str, dict[str, Any]] = {}
    for error, count in counts.most_common():
        examples: list[str] = []
        for r in failed:
            if r.error == error and r.error_detail not in examples:
                examples.append(r.error_detail)
                if len(examples) == MAX_ERROR_EXAMPLES:
                    break
        out[str(error)] = {"count": count, "examples": examples}
    return out


def bucket_size(duration: float) -> float:
    """A round bucket width giving at most about 50 buckets."""
    target = max(duration, 1e-3) / 50.0
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600):
        if step >= target:
            return float(step)
    return float(math.ceil(target / 600.0) * 600)


def timeline(records: Sequence[RequestRecord], duration: float) -> list[dict[str, float]]:
    """Per bucket: requests started, completed and failed per second, output tokens per second
    (each request's tokens spread over its text chunks' arrival times) and the mean number of
    requests in flight (request-seconds inside the bucket / its width)."""
    width = bucket_size(duration)
    n = max(1, math.ceil(duration / width))
    sent, done, failed, tokens = [0] * n, [0] * n, [0] * n, [0.0] * n
    busy = [0.0] * n

    def slot(t: float) -> int:
        return min(n - 1, max(0, int(t / width)))

    for r in records:
        if r.error == CANCELLED:
            continue
        sent[slot(r.start)] += 1
        (done if r.ok else failed)[slot(r.start + r.e2e)] += 1
        if r.chunk_times and r.output_tokens:
            per_chunk = r.output_tokens / len(r.chunk_times)
            for c in r.chunk_times:
                tokens[slot(r.start + c)] += per_chunk
        end = r.start + r.e2e
        for i in range(slot(r.start), slot(end) + 1):
            busy[i] += max(0.0, min(end, (i + 1) * width) - max(r.start, i * width))
    return [{"t_s": i * width, "sent_per_s": sent[i] / width,
             "completed_per_s": done[i] / width, "failed_per_s": failed[i] / width,
             "output_tokens_per_s": tokens[i] / width, "mean_in_flight": busy[i] / width}
            for i in range(n)]


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def per_request(r: RequestRecord) -> dict[str, Any]:
    return {"index": r.index, "start_s": r.start, "ttft_ms": _ms(r.ttft), "tpot_ms": _ms(r.tpot),
            "e2e_ms": _ms(r.e2e), "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "error": r.error}


def build_report(records: Sequence[RequestRecord], duration: float, slo: Slo,
                 config: dict[str, Any], interrupted: bool = False) -> dict[str, Any]:
    """The JSON report; ``duration`` runs from the start to the last request's end."""
    duration = max(duration, 1e-9)
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok and r.error != CANCELLED]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    good = sum(1 for r in ok if meets_slo(r, slo)) if slo.any else None
    attempted = len(ok) + len(failed)
    return {
        "config": config,
        "interrupted": interrupted,
        "duration_s": duration,
        "requests": {"sent": len(records), "completed": len(ok), "failed": len(failed),
                     "cancelled": len(records) - attempted,
                     "without_usage": sum(1 for r in ok if not r.usage_reported)},
        "tokens": {"prompt": prompt_tokens, "output": output_tokens},
        "throughput": {"requests_per_s": len(ok) / duration,
                       "output_tokens_per_s": output_tokens / duration,
                       "prompt_tokens_per_s": prompt_tokens / duration,
                       "total_tokens_per_s": (prompt_tokens + output_tokens) / duration},
        "slo": {"ttft_ms": _ms(slo.ttft), "tpot_ms": _ms(slo.tpot)},
        "goodput": None if good is None else {
            "requests_per_s": good / duration, "good_requests": good,
            "attainment": good / attempted if attempted else 0.0},
        "latency_ms": {
            "ttft": distribution(r.ttft for r in ok if r.ttft is not None),
            "tpot": distribution(t for r in ok if (t := r.tpot) is not None),
            "itl": distribution(x for r in ok for x in r.itls),
            "e2e": distribution(r.e2e for r in ok)},
        "errors": errors_by_type(records),
        "timeline": timeline(records, duration),
        "per_request": [per_request(r) for r in sorted(records, key=lambda r: r.start)],
    }
