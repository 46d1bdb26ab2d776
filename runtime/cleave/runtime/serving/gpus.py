"""``cleave up`` on a machine with several GPUs: each worker process gets its own.

Every worker would otherwise open ``cuda:0`` and all of them would share the first GPU. So
``cleave up`` gives each worker process one GPU through ``CUDA_VISIBLE_DEVICES``: inside the
worker that GPU is ``cuda:0``, its default KV budget (a share of the free memory) is read from
that GPU, and no flag changes. Workers are spread round-robin; with more workers than GPUs,
several share one, and a new worker (a restart keeps its GPU, an autoscaled one does not have
one yet) goes to the GPU with the fewest workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_gpus(env: Mapping[str, str], device_count: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each GPU torch sees, in torch's order: the
    parent's own list when it has one (indices or UUIDs), else the machine's indices."""
    if VISIBLE in env:
        entries = [e.strip() for e in env[VISIBLE].split(",")]
        return entries[:device_count]
    return [str(i) for i in range(device_count)]


def least_used(gpus: Sequence[str], in_use: Sequence[str]) -> str:
    """The GPU with the fewest workers on it, the first in order on a tie: for workers started
    one after another this is round-robin."""
    if not gpus:
        raise ValueError("no GPUs to choose from")
    return min(gpus, key=lambda g: (in_use.count(g), gpus.index(g)))


def cuda_device_count() -> int:
    """How many GPUs torch sees (0 when there is no NVIDIA driver, without importing torch)."""
    if not os.path.exists("/proc/driver/nvidia") and VISIBLE not in os.environ:
        return 0
    import torch

    return int(torch.cuda.device_count())


def gpus_for_workers(device: str, env: Mapping[str, str],
                     count: Callable[[], int] = cuda_device_count, ranks: int = 1) -> list[str]:
    """The GPUs to spread workers over; empty (leave every worker's environment as it is)
    on CPU, or with one GPU or none. With ``ranks`` > 1 (tensor parallelism) each entry is a
    group of that many GPUs (``"0,1"``), one per rank of a worker; GPUs left over go unused."""
    if device not in ("auto", "cuda"):
        return []
    gpus = visible_gpus(env, count())
    if ranks > 1:
        return [",".join(gpus[i:i + ranks]) for i in range(0, len(gpus) - ranks + 1, ranks)]
    return gpus if len(gpus) > 1 else []
