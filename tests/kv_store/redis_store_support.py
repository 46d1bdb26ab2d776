"""Shared by the Redis block store tests: block geometry, real bf16 blocks, metric readers and
a timed check that a call ends in StoreUnavailable. The fixtures are in ``conftest.py``."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from cleave.common import metric_names as names
from cleave.kv_store.block_hash import KVFingerprint, chain_hashes
from cleave.kv_store.codec import BlockHeader, encode
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.kv_store.store import EncodedBlock, StoredBlock, StoreUnavailable

# Fault tests give the store this short timeout (``FAULT_TIMEOUTS``) and time how soon a call
# gives up; tests against a healthy server use ``HEALTHY_TIMEOUT`` so a loaded CI box (the image
# check runs beside the suite) cannot turn a slow read into a failure.
TIMEOUT = 0.5
SLACK = 0.5
FAULT_TIMEOUTS = {"timeout_seconds": TIMEOUT, "connect_timeout_seconds": TIMEOUT}
HEALTHY_TIMEOUT = 10.0
BLOCK = 16
SHAPE = (2, 2, 2, BLOCK, 8)  # layers, k/v, kv heads, tokens, head dim: 8 KiB of bf16
REAL_SHAPE = (30, 2, 3, BLOCK, 64)  # SmolLM2-135M's layout: 720 KiB of bf16 per block
FP = KVFingerprint("SmolLM2-135M-Instruct", "sha256:0123", "bfloat16", num_layers=30,
                   num_kv_heads=3, head_dim=64, block_size=BLOCK, salt="tests")
FP_OTHER = KVFingerprint("SmolLM2-135M-Instruct", "sha256:0123", "bfloat16", num_layers=30,
                         num_kv_heads=3, head_dim=64, block_size=BLOCK, salt="other-tenant")

MakeStore = Callable[..., RedisBlockStore]


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels or None) or 0.0


_STORE_SERIES = {"hits": names.STORE_HITS, "misses": names.STORE_MISSES,
                 "corrupt_blocks": names.STORE_CORRUPT, "evictions_noticed": names.STORE_EVICTIONS,
                 "written_bytes": names.STORE_WRITTEN_BYTES, "read_bytes": names.STORE_READ_BYTES}

class StoreCounts:
    """The store's counters from the moment this is made: ``moved(*names)`` says how far each
    named one (``hits``, ``misses``, ``corrupt_blocks``, ``evictions_noticed``,
    ``written_bytes``, ``read_bytes``) has moved since."""

    def __init__(self) -> None:
        self._start = {name: self._now(name) for name in (
            "hits", "misses", "corrupt_blocks", "evictions_noticed", "written_bytes",
            "read_bytes")}

    @staticmethod
    def _now(name: str) -> float:
        return metric(names.total(_STORE_SERIES[name]))

    def moved(self, *which: str) -> tuple[float, ...]:
        return tuple(self._now(name) - self._start[name] for name in which)


def errors(op: str) -> float:
    return metric(names.total(names.STORE_ERRORS), op=op)


def bf16_payload(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def make_blocks(n: int, *, seed: int = 0, shape: tuple[int, ...] = SHAPE,
                fp: KVFingerprint = FP) -> tuple[list[EncodedBlock], list[torch.Tensor]]:
    """``n`` chained blocks of a prompt, each a real bf16 KV tensor encoded as stored."""
    tokens = [(seed * 7919 + i) % 49152 for i in range(n * BLOCK + 5)]  # + a partial block
    hashes = chain_hashes(fp.root_hash(), tokens, BLOCK)
    assert len(hashes) == n
    blocks, tensors = [], []
    for i, h in enumerate(hashes):
        t = bf16_payload(shape, seed * 1000 + i)
        payload = memoryview(t.contiguous().view(torch.uint8).numpy())
        blocks.append(EncodedBlock(h, encode(BlockHeader("bfloat16", shape, BLOCK, h), payload)))
        tensors.append(t)
    return blocks, tensors


def same_bits(stored: StoredBlock, t: torch.Tensor) -> bool:
    back = torch.frombuffer(bytearray(stored.payload), dtype=torch.bfloat16)
    return torch.equal(back.view(stored.header.shape).view(torch.int16), t.view(torch.int16))


def fill(plain: Any, sizes: dict[bytes, int]) -> dict[bytes, bytes]:
    """Random values of these sizes under these keys, written with a plain redis-py client."""
    values = {k: os.urandom(n) for k, n in sizes.items()}
    plain.delete(*values)
    plain.mset(values)
    return values


def unique_namespace(tag: str = "t") -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


async def expect_unavailable(call: Callable[[], Any], limit: float = TIMEOUT + SLACK
                             ) -> float:
    start = time.perf_counter()
    with pytest.raises(StoreUnavailable):
        await asyncio.wait_for(call(), limit + 5)  # the outer bound only catches a hang
    elapsed = time.perf_counter() - start
    assert elapsed <= limit, f"StoreUnavailable after {elapsed:.2f} s, allowed {limit} s"
    return elapsed
