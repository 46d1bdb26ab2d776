"""The human summary printed at the end of ``cleave bench``: a few lines and a latency table."""

from __future__ import annotations

from typing import Any

_COLUMNS = ("mean", "p50", "p90", "p95", "p99", "max")
_ROWS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))


def _line(label: str, value: str) -> str:
    return f"{label:<14}{value}"


def _slo_text(slo: dict[str, Any]) -> str:
    parts = []
    if slo.get("ttft_ms") is not None:
        parts.append(f"TTFT <= {slo['ttft_ms']:g} ms")
    if slo.get("tpot_ms") is not None:
        parts.append(f"TPOT <= {slo['tpot_ms']:g} ms")
    return " and ".join(parts)


def format_summary(report: dict[str, Any]) -> str:
    cfg, req, thr = report["config"], report["requests"], report["throughput"]
    lines = ["", "cleave bench" + ("  (INTERRUPTED: partial results)" if report["interrupted"]
                                   else "")]
    lines.append(_line("Endpoint", f"{cfg['endpoint_url']}  model {cfg['model']}"))
    lines.append(_line("Load", f"{cfg['load']}; {cfg['workload']}"))
    lines.append(_line("Duration", f"{report['duration_s']:.2f} s"))
    counts = f"{req['sent']} sent, {req['completed']} completed, {req['failed']} failed"
    if req["cancelled"]:
        counts += f", {req['cancelled']} cancelled"
    lines.append(_line("Requests", counts))
    source = ("server usage" if not req["without_usage"] else
              f"{req['without_usage']} requests without usage: text chunks counted instead")
    tok = report["tokens"]
    lines.append(_line("Tokens", f"prompt {tok['prompt']:,}, output {tok['output']:,} ({source})"))
    warm = report.get("warmup") or {}
    if warm.get("sent"):
        lines.append(_line("Warm-up", f"{warm['sent']} requests before the measured ones "
                                      f"({warm['failed']} failed), not in any figure"))
    lines.append(_line("Throughput", f"{thr['requests_per_s']:.2f} req/s, "
                                     f"{thr['output_tokens_per_s']:.1f} output tok/s, "
                                     f"{thr['total_tokens_per_s']:.1f} total tok/s"))
    good = report["goodput"]
    if good is not None:
        lines.append(_line("Goodput", f"{good['requests_per_s']:.2f} req/s "
                                      f"({good['attainment']:.0%} of requests within "
                                      f"{_slo_text(report['slo'])})"))
    server = report.get("server")
    if server and server["kv_store_hit_rate"] is not None:
        lines.append(_line("KV store", f"hit rate {server['kv_store_hit_rate']:.1%} of prompt "
                                       f"tokens ({server['kv_store_prefix_blocks']:,} prefix "
                                       f"blocks read, {server['kv_store_handoff_blocks']:,} "
                                       "handoff blocks)"))
    lines.append("")
    lines.append(f"{'Latency (ms)':<14}" + "".join(f"{c:>10}" for c in _COLUMNS))
    for label, key in _ROWS:
        dist = report["latency_ms"][key]
        cells = ("".join(f"{dist[c]:>10.1f}" for c in _COLUMNS) if dist
                 else f"{'(no data)':>10}")
        lines.append(f"{label:<14}{cells}")
    if report["errors"]:
        lines.append("")
        lines.append("Errors")
        for name, e in report["errors"].items():
            example = e["examples"][0] if e["examples"] else ""
            lines.append(f"  {name:<18}{e['count']:>6}  {example[:80]}")
    return "\n".join(lines)
