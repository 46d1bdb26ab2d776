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
    queued_tokens: int = 0  # prompt tokens this router has sent it that are not done yet
    role: str | None = None  # its current role, from /internal/stats (None: not known yet)
    max_model_len: int | None = None  # its context limit, from /internal/stats


@dataclass(frozen=True)
class PathChoice:
    disaggregate: bool
    reason: str


def choose_path(prompt_tokens: int, cached_prefix_tokens: int, has_prefill: bool,
                min_prompt_tokens: int, predicted_ttft: float | None = None,
                ttft_target: float | None = None, tokens_ahead: int = 0) -> PathChoice:
    """Conditional disaggregation: a separate prefill only pays when there is work to move.

    Short prompts, and prompts mostly covered by a cached prefix, are served whole by the
    decode worker: the handoff would cost more than the prefill it saves. So is a prompt whose
    prefill would wait behind a backlog (``tokens_ahead`` queued at the prefill worker) long
    enough to miss the TTFT target: the decode worker then prefills it in chunks inside its
    decode steps (a prefill worker's capacity converted to decode workers' spare compute,
    without a restart). Only a queue can be skipped that way: a prompt that misses the target
    on an idle prefill worker would miss it on a decode worker too (the same compute, chunked
    between decode steps and slowing them), and would leave no KV in the store for the next
    prompt sharing its prefix.
    """
    if not has_prefill:
        return PathChoice(False, "no_prefill_workers")
    if prompt_tokens < min_prompt_tokens:
        return PathChoice(False, "short_prompt")
    if prompt_tokens - cached_prefix_tokens < min_prompt_tokens:
        return PathChoice(False, "mostly_cached")
    if (tokens_ahead > 0 and predicted_ttft is not None and ttft_target is not None
            and predicted_ttft > ttft_target):
        return PathChoice(False, "prefill_backlog")
    return PathChoice(True, "long_prompt")


def predicted_prefill_seconds(worker: WorkerState, prompt_tokens: int,
                              seconds_per_token: float | None) -> float | None:
    """When a prefill sent now would finish: the tokens queued ahead of it and its own, at the
    worker's observed rate (None until a first prefill has measured one)."""
    if seconds_per_token is None:
        return None
    return (worker.queued_tokens + prompt_tokens) * seconds_per_token


def updated_rate(previous: float | None, seconds: float, tokens: int,
                 weight: float = 0.2) -> float | None:
    """An exponentially weighted seconds-per-prompt-token, from one prefill that took
    ``seconds`` to clear ``tokens`` (its own and those queued ahead of it)."""
    if tokens <= 0 or seconds <= 0:
        return previous
    sample = seconds / tokens
    return sample if previous is None else (1 - weight) * previous + weight * sample


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


def choose_server(decode: Sequence[WorkerState], prefill: Sequence[WorkerState],
                  exclude: frozenset[str] = frozenset()) -> tuple[str, WorkerState] | None:
    """Who runs a request's decode: a decode worker, or, when none is healthy, a prefill worker
    (every worker holds the whole model and can run both phases, so losing the only decode
    worker costs speed, not availability). Returns the pool's role and the worker."""
    worker = choose_decode(decode, exclude)
    if worker is not None:
        return "decode", worker
    worker = choose_decode(prefill, exclude)
    return ("prefill", worker) if worker is not None else None
