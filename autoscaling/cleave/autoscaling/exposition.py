"""Prometheus text exposition as the autoscaler reads it: one pod's scrape parsed into summed
histograms and values, and the windowed arithmetic on two scrapes (bucket deltas, quantiles)
that ``histogram_quantile`` over ``rate()`` does in Prometheus. Pure: no I/O, no clock."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Histogram:
    """One histogram family, summed over its label sets; ``cumulative`` as exported."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    count: float
    total: float


@dataclass(frozen=True)
class PodMetrics:
    histograms: Mapping[str, Histogram]
    values: Mapping[str, float]  # gauges and counters (family name, no ``_total``), summed
    roles: frozenset[str]


def parse_metrics(text: str) -> PodMetrics:
    """Parse Prometheus text exposition; ValueError if it is not that."""
    buckets: dict[str, dict[float, float]] = {}
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    values: dict[str, float] = {}
    roles: set[str] = set()
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError, IndexError, … on garbage
        raise ValueError(f"not Prometheus text: {e}") from e
    for family in families:
        for sample in family.samples:
            if "role" in sample.labels:
                roles.add(sample.labels["role"])
            if family.type == "histogram":
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    per = buckets.setdefault(family.name, {})
                    per[le] = per.get(le, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    counts[family.name] = counts.get(family.name, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    sums[family.name] = sums.get(family.name, 0.0) + sample.value
            elif family.type in ("gauge", "counter", "untyped") and not sample.name.endswith(
                    "_created"):
                values[family.name] = values.get(family.name, 0.0) + sample.value
    histograms = {
        name: Histogram(tuple(sorted(per)), tuple(per[b] for b in sorted(per)),
                        counts.get(name, 0.0), sums.get(name, 0.0))
        for name, per in buckets.items()}
    return PodMetrics(histograms, values, frozenset(roles))


def delta(older: Histogram | None, newer: Histogram) -> tuple[float, ...]:
    """Per-bucket cumulative counts observed between two scrapes; a reset (the pod restarted)
    or no older scrape means everything since the process started."""
    if older is None or older.bounds != newer.bounds or older.count > newer.count:
        return newer.cumulative
    return tuple(n - o for n, o in zip(newer.cumulative, older.cumulative, strict=True))


def quantile(q: float, bounds: tuple[float, ...], cumulative: tuple[float, ...]) -> float | None:
    if not cumulative or cumulative[-1] <= 0:
        return None
    rank = q * cumulative[-1]
    lower, below = 0.0, 0.0
    for bound, upto in zip(bounds, cumulative, strict=True):
        if upto >= rank:
            if math.isinf(bound):  # past the last finite bucket: its bound is all we know
                return lower
            inside = upto - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, upto
    return lower


def histogram_quantile(q: float, older: Histogram | None, newer: Histogram) -> float | None:
    """Quantile of the observations made between two scrapes; None if there were none."""
    return quantile(q, newer.bounds, delta(older, newer))



@dataclass(frozen=True)
class Scrape:
    """One scrape of one pod: ``metrics`` None when it did not answer."""

    at: float
    metrics: PodMetrics | None
