"""PNG plots of a run: latency CDFs, throughput over time, latency over time.

Figures are built with ``matplotlib.figure.Figure`` and the Agg canvas, never pyplot: no display
is needed and no global figure state is left behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from cleave.runtime.loadgen.record import CANCELLED, RequestRecord
from cleave.runtime.loadgen.report import percentile

LATENCY_CDF = "latency_cdf.png"
THROUGHPUT = "throughput_over_time.png"
LATENCY_OVER_TIME = "latency_over_time.png"


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _cdf(ax: Any, title: str, values_s: Sequence[float], slo_ms: float | None) -> None:
    ms = sorted(v * 1000.0 for v in values_s)
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of gaps")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if not ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ys = [(i + 1) / len(ms) for i in range(len(ms))]
    ax.step(ms, ys, where="post")
    for q, style in ((50, ":"), (99, "--")):  # the report's percentiles, to the digit
        ax.axvline(percentile(ms, q), color="gray", linestyle=style, linewidth=1,
                   label=f"p{q}")
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", linewidth=1.2, label="SLO")
    ax.legend(loc="lower right", fontsize=8)


def latency_cdfs(records: Sequence[RequestRecord], slo: dict[str, Any], path: Path) -> Path:
    ok = [r for r in records if r.ok]
    fig = Figure(figsize=(10, 7))
    axes = fig.subplots(2, 2)
    _cdf(axes[0][0], "TTFT (time to first token)",
         [r.ttft for r in ok if r.ttft is not None], slo.get("ttft_ms"))
    _cdf(axes[0][1], "TPOT (time per output token)",
         [t for r in ok if (t := r.tpot) is not None], slo.get("tpot_ms"))
    _cdf(axes[1][0], "ITL (inter-token latency)", [x for r in ok for x in r.itls], None)
    _cdf(axes[1][1], "E2E (end-to-end latency)", [r.e2e for r in ok], None)
    return _save(fig, path)


def throughput_over_time(timeline: Sequence[dict[str, float]], path: Path) -> Path:
    # Buckets are [t, t + width): a step plot needs the last bucket's end as one more point.
    width = timeline[1]["t_s"] - timeline[0]["t_s"] if len(timeline) > 1 else 1.0
    t = [b["t_s"] for b in timeline] + [timeline[-1]["t_s"] + width]

    def series(key: str) -> list[float]:
        return [b[key] for b in timeline] + [timeline[-1][key]]

    fig = Figure(figsize=(10, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.step(t, series("output_tokens_per_s"), where="post", color="tab:blue")
    top.set_ylabel("output tokens/s")
    top.set_title("Throughput over time")
    top.grid(alpha=0.3)
    for key, label, color in (("sent_per_s", "sent", "tab:gray"),
                              ("completed_per_s", "completed", "tab:green"),
                              ("failed_per_s", "failed", "tab:red")):
        bottom.step(t, series(key), where="post", label=label, color=color)
    bottom.set_ylabel("requests/s")
    bottom.set_xlabel("seconds since start")
    bottom.grid(alpha=0.3)
    flight = bottom.twinx()
    flight.step(t, series("mean_in_flight"), where="post", color="tab:orange",
                linestyle="--", label="in flight (mean)")
    flight.set_ylabel("requests in flight")
    handles = bottom.get_legend_handles_labels()
    more = flight.get_legend_handles_labels()
    bottom.legend(handles[0] + more[0], handles[1] + more[1], loc="upper right", fontsize=8)
    return _save(fig, path)


def latency_over_time(records: Sequence[RequestRecord], path: Path) -> Path:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok and r.error != CANCELLED]  # as the report counts
    fig = Figure(figsize=(10, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.scatter([r.start for r in ok if r.ttft is not None],
                [r.ttft * 1000 for r in ok if r.ttft is not None], s=8, label="TTFT")
    top.set_ylabel("TTFT (ms)")
    top.set_title("Latency by request start time")
    bottom.scatter([r.start for r in ok], [r.e2e * 1000 for r in ok], s=8, color="tab:green",
                   label="E2E")
    if failed:
        bottom.scatter([r.start for r in failed], [r.e2e * 1000 for r in failed], s=14,
                       marker="x", color="tab:red", label="failed (time to failure)")
    bottom.set_ylabel("E2E (ms)")
    bottom.set_xlabel("request start (seconds since start)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    return _save(fig, path)


def write_plots(records: Sequence[RequestRecord], report: dict[str, Any], out: Path
                ) -> list[Path]:
    return [latency_cdfs(records, report["slo"], out / LATENCY_CDF),
            throughput_over_time(report["timeline"], out / THROUGHPUT),
            latency_over_time(records, out / LATENCY_OVER_TIME)]
