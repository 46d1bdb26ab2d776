"""`cleave up` on several GPUs: each worker process sees its own (no GPU here: the assignment
is pure, and the supervisor's part is checked on stand-in processes)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from cleave.common.settings import WorkerSettings
from cleave.runtime.serving.gpus import VISIBLE, gpus_for_workers, least_used, visible_gpus
from cleave.runtime.serving.local_processes import Supervisor


def test_visible_gpus_are_the_machines_indices_or_the_parents_own_list() -> None:
    assert visible_gpus({}, 3) == ["0", "1", "2"]
    assert visible_gpus({VISIBLE: "2,3"}, 2) == ["2", "3"]
    assert visible_gpus({VISIBLE: "GPU-a, GPU-b"}, 2) == ["GPU-a", "GPU-b"]
    assert visible_gpus({VISIBLE: "4,5,6"}, 2) == ["4", "5"]  # torch sees fewer than listed
    assert visible_gpus({VISIBLE: ""}, 0) == []
    assert visible_gpus({}, 0) == []


def test_workers_go_round_robin_then_to_the_least_used_gpu() -> None:
    gpus = ["0", "1", "2"]
    in_use: list[str] = []
    for _ in range(7):
        in_use.append(least_used(gpus, in_use))
    assert in_use == ["0", "1", "2", "0", "1", "2", "0"]
    assert least_used(gpus, ["0", "0", "2"]) == "1"  # a worker on 1 was drained
    with pytest.raises(ValueError):
        least_used([], [])


@pytest.mark.parametrize(("device", "count", "expected"), [
    ("cuda", 2, ["0", "1"]), ("auto", 4, ["0", "1", "2", "3"]),
    ("cuda", 1, []),  # one GPU: every worker uses it, nothing to set
    ("auto", 0, []), ("cpu", 4, []),
])
def test_workers_are_spread_only_over_several_gpus_when_the_device_may_be_cuda(
        device: str, count: int, expected: list[str]) -> None:
    assert gpus_for_workers(device, {}, count=lambda: count) == expected


def test_cpu_never_asks_torch() -> None:
    def count() -> int:
        raise AssertionError("torch must not be asked on CPU")

    assert gpus_for_workers("cpu", {}, count=count) == []


@pytest.fixture()
def supervisor() -> Iterator[Supervisor]:
    # Stand-in workers: `python -c` ignores the worker flags after the code.
    sup = Supervisor([sys.executable, "-c", "import time; time.sleep(60)"], {"A": "1"},
                     WorkerSettings(), say=lambda _: None, gpus=["3", "5"])
    yield sup
    sup.stop_all(grace=5)


def test_each_worker_process_sees_one_gpu(supervisor: Supervisor) -> None:
    workers = [supervisor.spawn_worker(role) for role in ("prefill", "decode", "decode")]
    assert [w.env[VISIBLE] for w in workers] == ["3", "5", "3"]
    assert [w.gpu for w in workers] == ["3", "5", "3"]
    assert all(w.env["A"] == "1" for w in workers)  # the rest of the environment is kept
    supervisor.forget(workers[1])  # drained and gone: its GPU is free again
    assert supervisor.spawn_worker("decode").gpu == "5"


def test_without_gpus_the_environment_is_left_alone() -> None:
    sup = Supervisor([sys.executable, "-c", "pass"], {"A": "1"}, WorkerSettings(),
                     say=lambda _: None)
    try:
        worker = sup.spawn_worker("both")
        assert worker.env == {"A": "1"} and worker.gpu is None
    finally:
        sup.stop_all(grace=5)
