"""Simulated prefill and decode replicas: queues, batching, KV capacity, and the metrics each
exports the way a Cleave worker's /metrics does (histograms with the runtime's buckets)."""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass

from cleave.autoscaling.costmodel import CostModel
from cleave.autoscaling.signals import (
    GENERATION_TOKENS,
    KV_USAGE,
    PROMPT_TOKENS,
    TPOT,
    TTFT,
    WAITING,
    Histogram,
    PodMetrics,
)
from cleave.common import metric_names as names

RUNNING = names.RUNNING
INF = float("inf")
# The runtime's buckets, so windowed p90s carry the same bucket error (and +Inf, as exported).
LATENCY_BUCKETS = (*names.LATENCY_BUCKETS, INF)
TPOT_BUCKETS = (*names.TPOT_BUCKETS, INF)


class SimRequest:
    __slots__ = ("arrival", "finish_step", "n_in", "n_out", "routed", "t_done", "t_first")

    def __init__(self, arrival: float, n_in: int, n_out: int) -> None:
        self.arrival, self.n_in, self.n_out = arrival, n_in, n_out
        self.t_first = INF
        self.t_done = INF
        self.finish_step = 0
        self.routed = False  # a path was counted for it (re-dispatch does not count again)

    @property
    def ttft(self) -> float:
        return self.t_first - self.arrival

    @property
    def tpot(self) -> float:
        """As the client sees it: the wait for a decode slot after the first token counts."""
        if self.t_done == INF:
            return INF
        return (self.t_done - self.t_first) / (self.n_out - 1) if self.n_out > 1 else 0.0


class _Hist:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.total = bounds, [0.0] * len(bounds), 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.total += value * n

    def snapshot(self) -> Histogram:
        cumulative, run = [], 0.0
        for c in self.counts:
            run += c
            cumulative.append(run)
        return Histogram(self.bounds, tuple(cumulative), run, self.total)


@dataclass
class Lifetime:
    born: float  # when its GPUs were claimed (pods pending hold none)
    ready_at: float
    gone: float = INF
    draining: bool = False


class PrefillReplica:
    role = "prefill"

    def __init__(self, name: str, life: Lifetime, cost: CostModel) -> None:
        self.name, self.life, self.cost = name, life, cost
        self.queue: deque[SimRequest] = deque()  # its head is the prompt being computed
        self.busy = False
        self.prompt_tokens = 0.0
        self.ttft = _Hist(LATENCY_BUCKETS)

    @property
    def load(self) -> int:
        return len(self.queue)

    def enqueue(self, req: SimRequest, now: float) -> float | None:
        """Queue a request; the time its prefill ends if the replica was idle."""
        self.queue.append(req)
        return None if self.busy else self._start(now)

    def _start(self, now: float) -> float | None:
        if not self.queue:
            self.busy = False
            return None
        self.busy = True
        return now + self.cost.prefill_seconds(self.queue[0].n_in)

    def finish(self, now: float) -> tuple[SimRequest, float | None]:
        """The request whose prefill ended now (its first token comes after the KV save)
        and when the next one ends."""
        req = self.queue.popleft()
        req.t_first = now + self.cost.kv_transfer_seconds(req.n_in)
        self.prompt_tokens += req.n_in
        self.ttft.observe(req.ttft)
        return req, self._start(now)

    def metrics(self) -> PodMetrics:
        return PodMetrics({TTFT: self.ttft.snapshot()},
                          {WAITING: float(len(self.queue) - self.busy), RUNNING: float(self.busy),
                           PROMPT_TOKENS: self.prompt_tokens}, frozenset({self.role}))


class DecodeReplica:
    """Continuous batching: requests join at step boundaries if their KV (prompt + output,
    reserved at admission, no preemption) fits; each step emits one token per sequence."""

    role = "decode"

    def __init__(self, name: str, life: Lifetime, cost: CostModel) -> None:
        self.name, self.life, self.cost = name, life, cost
        self.capacity = cost.kv_capacity_tokens()
        self.waiting: deque[SimRequest] = deque()
        self.finishing: list[tuple[int, int, SimRequest]] = []
        self.steps = 0
        self.context = 0  # KV tokens the running batch reads each step
        self.reserved = 0
        self.stepping = False
        self.step_batch = 0
        self.step_started = 0.0
        self.generated = 0.0
        self.tpot = _Hist(TPOT_BUCKETS)
        self._seq = 0

    @property
    def running(self) -> int:
        return len(self.finishing)

    @property
    def kv_usage(self) -> float:
        return self.reserved / self.capacity

    @property
    def load(self) -> int:
        return len(self.waiting) + self.running

    def enqueue(self, req: SimRequest, now: float) -> float | None:
        """Queue a request whose KV has arrived; when the next step ends if it was idle."""
        self.waiting.append(req)
        return None if self.stepping else self._admit_and_step(now)

    def _admit_and_step(self, now: float) -> float | None:
        cost = self.cost
        while self.waiting and self.running < cost.max_num_seqs:
            req = self.waiting[0]
            need = req.n_in + req.n_out
            if self.reserved + need > self.capacity and self.running > 0:
                break  # FIFO: the head waits for room, nothing overtakes it
            self.waiting.popleft()
            self.reserved += need
            self.context += req.n_in + 1
            req.finish_step = self.steps + req.n_out - 1
            self._seq += 1
            heapq.heappush(self.finishing, (req.finish_step, self._seq, req))
        if not self.finishing:
            self.stepping = False
            return None
        self.stepping = True
        self.step_batch = self.running
        self.step_started = now
        return now + cost.decode_step_seconds(self.step_batch, self.context)

    def step_done(self, now: float) -> tuple[list[SimRequest], float | None]:
        """Close a step: every running sequence got a token; returns the finished requests
        and when the next step ends."""
        batch = self.step_batch
        self.steps += 1
        self.generated += batch
        self.tpot.observe(now - self.step_started, batch)
        self.context += batch
        done = []
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, _, req = heapq.heappop(self.finishing)
            req.t_done = now
            self.context -= req.n_in + req.n_out
            self.reserved -= req.n_in + req.n_out
            done.append(req)
        return done, self._admit_and_step(now)

    def metrics(self) -> PodMetrics:
        return PodMetrics({TPOT: self.tpot.snapshot()},
                          {WAITING: float(len(self.waiting)), RUNNING: float(self.running),
                           KV_USAGE: self.kv_usage, GENERATION_TOKENS: self.generated},
                          frozenset({self.role}))


Replica = PrefillReplica | DecodeReplica
