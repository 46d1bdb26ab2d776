"""A simulated worker: one engine that holds the whole model and runs either phase or both.

Every step carries the running decode batch (one token each) and at most one prefill chunk
(:meth:`CostModel.step_seconds` prices the mix). What the chunk may hold depends on the job:

- a *handoff* job (the router sent only the prompt: this worker serves prefill) runs whole, as a
  prefill worker does; its first token is out once its KV is saved to the store;
- a *local* job (the whole request: a decode worker taking a prompt the prefill backlog would
  make late, a prefill worker serving whole while no decode worker is up, or a ``both`` worker)
  reserves its prompt + output KV here, is prefilled in chunks within the role's per-step token
  budget, and its sequence joins this worker's batch with its first token.

A flip changes the role the router sends new work for, after ``flip_s`` during which it takes
none; the work in flight finishes where it is. A new worker is slow for its first steps.
"""

from __future__ import annotations

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
    PodMetrics,
)
from cleave.autoscaling.simreplicas import (
    INF,
    LATENCY_BUCKETS,
    RUNNING,
    TPOT_BUCKETS,
    Lifetime,
    SimRequest,
    _Hist,
)

PREFILL, DECODE, BOTH = "prefill", "decode", "both"


@dataclass(frozen=True)
class EngineConfig:
    """Per-step token budgets by role (decode tokens included, as vLLM counts them) and the
    slow first steps of a new engine."""

    # A decode worker's per-step budget (max_num_batched_tokens). None: sized so a step stays
    # within the TPOT target (CostModel.chunk_budget); the engine's default of 512 would make
    # a 70B step on 2 x H200 take ~85 ms, over a 50 ms TPOT SLO.
    decode_budget: int | None = None
    both_budget: int = 8192  # vLLM V1's default for the OpenAI server on 80 GB GPUs
    warmup_s: float = 60.0  # after ready: lazily compiled kernels, allocator growth
    warmup_slowdown: float = 1.5  # step time factor while warming (an assumption, stated)
    # True: a sequence reserves its prompt + whole output KV when admitted, and is never
    # preempted. False: as vLLM's scheduler (and Cleave's engine) do, it takes its prompt's KV
    # and one token a step, and when the cache is full the newest sequence is preempted: its
    # KV freed, recomputed (prompt + what it generated) ahead of new work, then resumed.
    reserve_output: bool = True


class _Job:
    __slots__ = ("done", "handoff", "left", "length", "req", "reserved")

    def __init__(self, req: SimRequest, handoff: bool, length: int = 0, left: int = 0) -> None:
        self.req, self.handoff, self.done, self.reserved = req, handoff, 0, False
        self.length = length or req.n_in  # tokens to prefill: a preempted one recomputes more
        self.left = left  # > 0: a preempted sequence's tokens still to generate


class Worker:
    def __init__(self, name: str, home: str, life: Lifetime, cost: CostModel,
                 engine: EngineConfig, role: str | None = None) -> None:
        self.name, self.home, self.life, self.cost, self.engine = name, home, life, cost, engine
        self.role = role or home
        self.role_at = life.ready_at  # takes new work of its role from then on
        self.capacity = cost.kv_capacity_tokens()
        self.jobs: deque[_Job] = deque()
        self.waiting: deque[SimRequest] = deque()  # handed off here, KV loaded
        self.finishing: list[tuple[int, int, SimRequest]] = []
        self.joined: dict[int, tuple[int, int]] = {}  # seq number: (step joined, KV held then)
        self.preemptions = 0
        self.steps = self.context = self.reserved = self._seq = 0
        self.stepping = False
        self.step_batch = self.step_chunk = 0
        self.step_started = 0.0
        self.prompt_tokens = self.generated = 0.0
        self.ttft = _Hist(LATENCY_BUCKETS)
        self.tpot = _Hist(TPOT_BUCKETS)
        self.flips = 0
        self.firsts: list[SimRequest] = []  # local first tokens since the simulator last looked

    # --- what the router reads --------------------------------------------------------------

    def serves(self, role: str, now: float) -> bool:
        return (not self.life.draining and self.life.ready_at <= now and self.role_at <= now
                and self.role in (role, BOTH))

    @property
    def running(self) -> int:
        return len(self.finishing)

    @property
    def load(self) -> int:
        return len(self.jobs) + len(self.waiting) + self.running

    @property
    def queued_tokens(self) -> int:
        return sum(j.req.n_in - j.done for j in self.jobs)

    @property
    def kv_usage(self) -> float:
        return self.reserved / self.capacity

    def flip(self, role: str, now: float, flip_s: float) -> None:
        self.role, self.role_at = role, now + flip_s
        self.flips += 1

    # --- work -------------------------------------------------------------------------------

    def submit(self, req: SimRequest, now: float, handoff: bool) -> float | None:
        """A prompt to prefill (``handoff``: only the prefill); when the next step ends if the
        engine was idle."""
        self.jobs.append(_Job(req, handoff))
        return None if self.stepping else self._step(now)

    def admit(self, req: SimRequest, now: float) -> float | None:
        """A sequence whose KV arrived from the store, to decode."""
        self.waiting.append(req)
        return None if self.stepping else self._step(now)

    def _budget(self, job: _Job) -> int:
        if job.handoff or self.role == PREFILL:
            return job.req.n_in  # a prefill worker runs a prompt whole
        budget = self.engine.both_budget if self.role == BOTH else self.engine.decode_budget
        assert budget is not None, "the simulation resolves the decode budget"
        return max(1, budget - len(self.finishing))  # at least a token: no starvation

    def _need(self, req: SimRequest, tokens: int) -> int:
        """KV tokens a sequence takes when admitted with ``tokens`` of context."""
        return req.n_in + req.n_out if self.engine.reserve_output else tokens

    def _admit(self) -> None:
        while self.waiting and self.running < self.cost.max_num_seqs:
            req = self.waiting[0]
            need = self._need(req, req.n_in + 1)
            if self.reserved + need > self.capacity and self.running > 0:
                break  # FIFO: the head waits for room
            self.waiting.popleft()
            self.reserved += need
            self._join(req, req.n_out - 1, req.n_in + 1)

    def _join(self, req: SimRequest, tokens_left: int, context: int) -> None:
        self.context += context
        req.finish_step = self.steps + tokens_left
        self._seq += 1
        self.joined[self._seq] = (self.steps, context)
        heapq.heappush(self.finishing, (req.finish_step, self._seq, req))

    def _held(self, seq: int) -> int:
        joined, context = self.joined[seq]
        return context + self.steps - joined

    def _preempt(self) -> None:
        """The cache is over full (growing sequences): free the newest sequences' KV and queue
        them, ahead of new work, to recompute their prompt and what they generated."""
        while self.reserved > self.capacity and self.running > 1:
            i = max(range(len(self.finishing)), key=lambda k: self.finishing[k][1])
            finish, seq, req = self.finishing.pop(i)
            heapq.heapify(self.finishing)
            held = self._held(seq)
            del self.joined[seq]
            self.reserved -= held
            self.context -= held
            self.preemptions += 1
            self.jobs.appendleft(_Job(req, False, held - 1, finish - self.steps))

    def _chunk(self) -> tuple[_Job | None, int]:
        if not self.jobs:
            return None, 0
        job = self.jobs[0]
        if not job.handoff and not job.reserved:
            need = self._need(job.req, job.length)
            if self.reserved + need > self.capacity and (self.running or self.reserved):
                return None, 0  # its KV does not fit yet: decode frees it
            self.reserved += need
            job.reserved = True
        return job, min(job.length - job.done, self._budget(job))

    def _step(self, now: float) -> float | None:
        self._admit()
        job, chunk = self._chunk()
        if not self.finishing and not chunk:
            self.stepping = False
            return None
        self.stepping = True
        self.step_batch, self.step_chunk, self.step_started = self.running, chunk, now
        offset = job.done if job else 0
        t = self.cost.step_seconds(self.step_batch, self.context, chunk, offset)
        if now < self.life.ready_at + self.engine.warmup_s:
            t *= self.engine.warmup_slowdown
        return now + t

    def step_done(self, now: float) -> tuple[list[SimRequest], list[SimRequest], float | None]:
        """Close a step: (requests finished, prefills to hand off, when the next step ends)."""
        batch = self.step_batch
        if batch:
            self.steps += 1
            self.generated += batch
            self.tpot.observe(now - self.step_started, batch)
            self.context += batch
            if not self.engine.reserve_output:
                self.reserved += batch
        done: list[SimRequest] = []
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, seq, req = heapq.heappop(self.finishing)
            req.t_done = now
            held = self._held(seq)
            del self.joined[seq]
            self.context -= held
            self.reserved -= req.n_in + req.n_out if self.engine.reserve_output else held
            done.append(req)
        handed: list[SimRequest] = []
        if self.step_chunk:
            job = self.jobs[0]
            job.done += self.step_chunk
            if job.done >= job.length:
                self.jobs.popleft()
                self._prefilled(job, now, done, handed)
        if not self.engine.reserve_output:
            self._preempt()  # after the chunk's job is closed: the preempted go in front
        return done, handed, self._step(now)

    def _prefilled(self, job: _Job, now: float, done: list[SimRequest],
                   handed: list[SimRequest]) -> None:
        req = job.req
        if job.left:  # a preempted sequence, recomputed: it goes on where it was
            self.reserved += 1  # its last sampled token, as at its first join
            self._join(req, job.left, job.length + 1)
            return
        self.prompt_tokens += req.n_in
        if job.handoff:
            req.t_first = now + self.cost.kv_transfer_seconds(req.n_in)
            handed.append(req)
        else:
            req.t_first = now  # the step that finished the prompt sampled its first token
            self.firsts.append(req)
            if req.n_out <= 1:
                req.t_done = now
                self.reserved -= self._need(req, req.n_in)
                done.append(req)
            else:
                self.reserved += 0 if self.engine.reserve_output else 1  # its first token
                self._join(req, req.n_out - 1, req.n_in + 1)
        self.ttft.observe(req.ttft)

    def withdraw(self, arrived_after: float = -INF) -> list[SimRequest]:
        """Take out the prompts queued here whose prefill has not started (not computing, no
        chunk done, no KV reserved, not a preempted sequence's recompute) and that arrived
        after ``arrived_after``, for the router to send elsewhere; the rest keep their order."""
        computing = self.stepping and self.step_chunk > 0  # on the head job
        kept: deque[_Job] = deque()
        out: list[SimRequest] = []
        for i, job in enumerate(self.jobs):
            started = (i == 0 and computing) or job.done or job.reserved or job.left
            if started or job.req.arrival <= arrived_after:
                kept.append(job)
            else:
                out.append(job.req)
        self.jobs = kept
        return out

    def idle(self) -> bool:
        return not self.stepping and not self.jobs and not self.waiting

    def metrics(self, role: str | None = None) -> PodMetrics:
        """What the worker exports, all of it, or the view of one phase: a decode worker's
        prefills of whole requests are prefill work (prompt tokens, TTFT, prompts waiting)."""
        computing = bool(self.stepping and self.step_chunk)  # its head job is not waiting
        prompts = float(len(self.jobs) - computing)
        if role == PREFILL:
            return PodMetrics({TTFT: self.ttft.snapshot()},
                              {WAITING: prompts, RUNNING: float(computing),
                               PROMPT_TOKENS: self.prompt_tokens}, frozenset({PREFILL}))
        if role == DECODE:
            return PodMetrics({TPOT: self.tpot.snapshot()},
                              {WAITING: float(len(self.waiting)), RUNNING: float(self.running),
                               KV_USAGE: self.kv_usage, GENERATION_TOKENS: self.generated},
                              frozenset({DECODE}))
        return PodMetrics({TTFT: self.ttft.snapshot(), TPOT: self.tpot.snapshot()},
                          {WAITING: prompts + len(self.waiting), RUNNING: float(self.running),
                           KV_USAGE: self.kv_usage, PROMPT_TOKENS: self.prompt_tokens,
                           GENERATION_TOKENS: self.generated}, frozenset({self.role}))


__all__ = ["BOTH", "DECODE", "INF", "PREFILL", "EngineConfig", "Worker"]
