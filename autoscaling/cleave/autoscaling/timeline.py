"""PNG timeline of a simulation: load, replicas per role, p90 TTFT and TPOT against the SLOs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cleave.autoscaling.simulator import SimResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def draw_timeline(result: SimResult, path: str | Path, title: str | None = None) -> Path:
    """Write the timeline; the p90s are client-side, over the requests of each interval."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    samples = result.samples
    if not samples:
        raise ValueError("nothing to draw: the simulation recorded no interval")
    minutes = [s.t / 60 for s in samples]
    cfg = result.config
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True,
                             gridspec_kw={"height_ratios": [1, 1.2, 1, 1]})
    load, reps, ttft, tpot = axes

    load.plot(minutes, [s.load for s in samples], color="tab:gray", lw=1)
    load.set_ylabel("arrivals (req/s)")
    gpus = load.twinx()
    gpus.step(minutes, [s.gpus for s in samples], where="post", color="tab:purple", lw=1.2)
    gpus.set_ylabel("GPUs held", color="tab:purple")

    for i, (role, color) in enumerate((("prefill", "tab:blue"), ("decode", "tab:orange"))):
        reps.step(minutes, [s.ready[i] for s in samples], where="post", color=color, lw=1.5,
                  label=f"{role} ready")
        reps.step(minutes, [s.ready[i] + s.starting[i] for s in samples], where="post",
                  color=color, lw=1, ls="--", label=f"{role} ready + starting")
    reps.set_ylabel("replicas")
    reps.legend(loc="upper right", fontsize=8, ncol=2)

    def latency(ax: Axes, values: list[float | None], slo: float, label: str) -> None:
        xs = [m for m, v in zip(minutes, values, strict=True) if v is not None]
        ys = [max(v, 1e-4) for v in values if v is not None]
        ax.plot(xs, ys, color="tab:green", lw=1, label=f"p90 {label} (interval)")
        ax.axhline(slo, color="tab:red", ls="--", lw=1, label=f"SLO {slo:g} s")
        ax.set_ylabel(f"{label} (s)")
        ax.legend(loc="upper right", fontsize=8)

    latency(ttft, [s.ttft_p90 for s in samples], cfg.ttft_slo, "TTFT")
    ttft.set_yscale("log")
    latency(tpot, [s.tpot_p90 for s in samples], cfg.tpot_slo, "TPOT")
    tpot.set_xlabel("minutes")
    fig.suptitle(title or (f"{result.policy} on {result.trace}: SLO attainment "
                           f"{result.slo_attainment():.3f}, {result.gpu_hours():.2f} GPU-hours"))
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
