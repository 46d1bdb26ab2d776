"""`cleave up --tensor-parallel-size N` on several GPUs: each worker sees a group of N GPUs, one
per rank (pure assignment; no GPU here)."""

from __future__ import annotations

from cleave.runtime.serving.gpus import VISIBLE, gpus_for_workers, least_used


def test_tensor_parallel_workers_get_groups_of_gpus() -> None:
    assert gpus_for_workers("cuda", {}, lambda: 4, ranks=2) == ["0,1", "2,3"]
    assert gpus_for_workers("auto", {VISIBLE: "4,5,6"}, lambda: 3, ranks=2) == ["4,5"]
    assert gpus_for_workers("cuda", {}, lambda: 2, ranks=2) == ["0,1"]
    assert gpus_for_workers("cuda", {}, lambda: 1, ranks=2) == []  # the engine says it needs 2
    assert gpus_for_workers("cpu", {}, lambda: 4, ranks=2) == []
    assert gpus_for_workers("cuda", {}, lambda: 4) == ["0", "1", "2", "3"]  # one rank: one GPU
    groups = gpus_for_workers("cuda", {}, lambda: 4, ranks=2)
    in_use: list[str] = []
    for _ in range(3):
        in_use.append(least_used(groups, in_use))
    assert in_use == ["0,1", "2,3", "0,1"]
