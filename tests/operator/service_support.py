"""LLMService objects for the autoscaler's tests: one service, its roles as given."""

from __future__ import annotations

from typing import Any

# An autoscaled role (2..6 replicas against a 0.5 s TTFT target) whose replicas field (5) the
# operator must not write.
AUTO = {"replicas": 5, "autoscaling": {"minReplicas": 2, "maxReplicas": 6, "ttftSeconds": 0.5}}


def spec_of(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None,
            **autoscaling: Any) -> dict[str, Any]:
    """The LLMService ``default/chat``: ``prefill`` only when given, ``autoscaling`` as
    ``spec.autoscaling``."""
    spec: dict[str, Any] = {"model": {"name": "m", "source": "m"}, "decode": decode or {},
                            "kvStore": {"managed": {}}, "autoscaling": autoscaling}
    if prefill is not None:
        spec["prefill"] = prefill
    return {"apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "default", "uid": "u1"}, "spec": spec}
