"""Routing decisions as pure functions: which path, which prefill worker, which decode worker.

Kept free of I/O so every rule is unit-tested directly; the router feeds them the workers'
last-known state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerState:
    url: str
    healthy: bool = True
    inflight: int = 0  # requests this router has open on it
    kv_usage: float = 0.0  # its KV pool usage ratio, from /internal/stats
    waiting: int = 0


@dataclass(frozen=True)
class PathChoice:
    disaggregate: bool
    reason: str


def choose_path(prompt_tokens: int, cached_prefix_tokens: int, has_prefill: bool,
                min_prompt_tokens: int) -> PathChoice:
    """Conditional disaggregation: a separate prefill only pays when there is work to move.

    Short prompts, and prompts mostly covered by a cached prefix, are served whole by the
    decode worker: the handoff would cost more than the prefill it saves.
    """
    if not has_prefill:
        return PathChoice(False, "no_prefill_workers")
    if prompt_tokens < min_prompt_tokens:
        return PathChoice(False, "short_prompt")
    if prompt_tokens - cached_prefix_tokens < min_prompt_tokens:
        return PathChoice(False, "mostly_cached")
    return PathChoice(True, "long_prompt")


def _affinity(url: str, key: bytes) -> bytes:
    return hashlib.sha256(key + url.encode()).digest()


def choose_prefill(workers: Sequence[WorkerState], prefix_key: bytes,
                   max_imbalance: int = 2) -> WorkerState | None:
    """Prefix affinity with a load guard.

    Rendezvous hashing on the prompt's first block sends prompts that share a prefix to the
    same worker (its local prefix cache then hits); if that worker has ``max_imbalance`` more
    requests open than the least-loaded one, load wins.
    """
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        return None
    preferred = max(healthy, key=lambda w: _affinity(w.url, prefix_key))
    least = min(healthy, key=lambda w: (w.inflight + w.waiting, w.url))
    if preferred.inflight + preferred.waiting - (least.inflight + least.waiting) > max_imbalance:
        return least
    return preferred


def choose_decode(workers: Sequence[WorkerState],
                  exclude: frozenset[str] = frozenset()) -> WorkerState | None:
    """The worker with the most free KV capacity, then the fewest open requests."""
    healthy = [w for w in workers if w.healthy and w.url not in exclude]
    if not healthy:
        return None
    return min(healthy, key=lambda w: (round(w.kv_usage, 1), w.inflight + w.waiting, w.url))
