"""The operator's own Prometheus metrics: what the autoscaler wants and how often it moved.

Served by ``cleave operator --metrics-port`` (docs/metrics.md). The label is ``llmservice``, as
on the data-plane series the chart's ServiceMonitor relabels, so one dashboard variable filters
both.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge

from cleave.common import metric_names as names

DESIRED = Gauge(
    names.AUTOSCALER_DESIRED,
    "Replicas the Cleave autoscaler wants for a role (advisory=true: dry-run, not acted on)",
    ["llmservice", "namespace", "role", "advisory"])
DECISIONS = Counter(
    names.AUTOSCALER_DECISIONS,
    "Changes of a role's desired replicas decided by the Cleave autoscaler",
    ["llmservice", "namespace", "role", "direction", "advisory"])
_shown: set[tuple[str, str, str, str]] = set()  # the DESIRED series that exist


def _flag(advisory: bool) -> str:
    return "true" if advisory else "false"


def set_desired(service: str, namespace: str, role: str, replicas: int, advisory: bool) -> None:
    DESIRED.labels(service, namespace, role, _flag(advisory)).set(replicas)
    _shown.add((service, namespace, role, _flag(advisory)))
    # One series per role: switching dryRun must not leave the other one behind, frozen.
    other = (service, namespace, role, _flag(not advisory))
    if other in _shown:
        _shown.discard(other)
        DESIRED.remove(*other)


def count_decision(service: str, namespace: str, role: str, direction: str,
                   advisory: bool) -> None:
    DECISIONS.labels(service, namespace, role, direction, _flag(advisory)).inc()


def forget(service: str, namespace: str, keep: Iterable[str] = ()) -> None:
    """Drop a deleted (or no longer autoscaled) service's desired-replicas series, all but
    those of the roles in ``keep`` (the ones still autoscaled)."""
    kept = set(keep)
    for labels in [s for s in _shown if s[:2] == (service, namespace) and s[2] not in kept]:
        _shown.discard(labels)
        DESIRED.remove(*labels)
