"""Continuous batching with chunked prefill and preemption by recompute; torch-free.

Each step gets a token budget. Running sequences are served first, oldest first (a decode
costs one token, an unfinished prefill continues with a chunk), then waiting sequences are
admitted while blocks and budget last. A long prompt is thus split across steps instead of
stalling every decode behind it. When the pool runs out, the youngest running sequence is
preempted: its blocks are freed and it is recomputed later from its tokens so far.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cleave.runtime.engine.block_manager import BlockManager
from cleave.runtime.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(f"invalid scheduler limits: {self}")


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``start`` are computed this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """A token is sampled when the chunk reaches the end of the sequence's tokens."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class BlockLoad:
    """External KV for blocks ``[first, end)`` of ``seq`` must be written before the forward."""

    seq: Sequence
    first: int
    end: int


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.allocate(seq):
                break  # first come, first served: do not let smaller requests jump the queue
            self.waiting.popleft()
            self._apply_external_kv(seq, out)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return out

    def _apply_external_kv(self, seq: Sequence, out: SchedulerOutput) -> None:
        local_blocks = seq.num_computed_tokens // self.blocks.block_size
        usable = min(seq.num_external_blocks, (seq.num_tokens - 1) // self.blocks.block_size)
        if usable > local_blocks:
            out.loads.append(BlockLoad(seq, local_blocks, usable))
            seq.num_computed_tokens = usable * self.blocks.block_size

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_external_blocks = 0  # its KV now lives (if anywhere) in the prefix cache
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def commit(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Record a finished step: ``sampled`` maps ``id(seq)`` to its new token.

        Returns the sequences that got a token, in chunk order; finished ones are released.
        """
        updated: list[Sequence] = []
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.blocks.mark_computed(seq)
            if not chunk.samples:
                continue
            token = sampled[id(seq)]
            seq.token_ids.append(token)
            updated.append(seq)
            reason = seq.stop_reason_after(token, self.config.max_model_len)
            if reason is not None:
                self.finish(seq, reason)
        return updated

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.blocks.free(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        for seq in [*self.running, *self.waiting]:
            if seq.request_id == request_id:
                self.finish(seq, FinishReason.ABORT)
                return seq
        return None
