"""A worker role's GPUs per pod become its engine's tensor-parallel size, on the command line
the real CLI parses."""

from __future__ import annotations

from typing import Any

import pytest

from cleave.common.cli import build_parser
from cleave.common.settings import WorkerSettings
from cleave.operator.builders import worker_settings
from cleave.operator.spec import parse_spec


def _spec(prefill_resources: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"},
        "spec": {"model": {"name": "big", "source": "/models/big"},
                 "prefill": {"replicas": 1, "resources": prefill_resources},
                 "decode": {"replicas": 1}, "kvStore": {"managed": {"memory": "1Gi"}}},
    }


@pytest.mark.parametrize(("resources", "size"), [
    ({"limits": {"nvidia.com/gpu": "2"}}, 2),
    ({"limits": {"nvidia.com/gpu": 4}}, 4),
    ({"limits": {"nvidia.com/gpu": 1}}, 1),
    ({}, 1),  # a CPU pod: one rank
])
def test_gpus_per_pod_become_the_tensor_parallel_size(resources: dict[str, Any],
                                                      size: int) -> None:
    spec = parse_spec(_spec(resources))
    assert spec.prefill is not None
    args = ["worker", *worker_settings(spec, "prefill", spec.prefill).to_args()]
    assert (f"--tensor-parallel-size={size}" in args) == (size > 1)
    parsed = WorkerSettings.from_args(build_parser().parse_args(args))
    assert parsed.engine.tensor_parallel_size == size
