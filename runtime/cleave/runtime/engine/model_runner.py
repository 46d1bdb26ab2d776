"""Turns a scheduler step into one forward over the paged pool, then samples."""

from __future__ import annotations

import torch
from cleave.runtime.engine.kv_pool import KVPool
from cleave.runtime.engine.llama import AttentionBatch, PagedLlama
from cleave.runtime.engine.sampler import sample
from cleave.runtime.engine.scheduler import ScheduledChunk, SchedulerOutput
from cleave.runtime.engine.sequence import Sequence, TokenLogprob


class ModelRunner:
    def __init__(self, model: PagedLlama, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.block_size = pool.block_size
        self.device = model.device

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, AttentionBatch]:
        bs = self.block_size
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_at: list[int] = []
        for c in decodes:
            logits_at.append(len(ids))
            ids.append(c.seq.token_ids[c.start])
            positions.append(c.start)
            slots += self._slots(c.seq, c.start, c.start + 1)
        tables = mask = None
        if decodes:
            width = max(-(-(c.start + 1) // bs) for c in decodes)
            tables = torch.tensor([_pad(c.seq.block_table[:width], width) for c in decodes],
                                  dtype=torch.long, device=self.device)
            lengths = self._tensor([c.start + 1 for c in decodes])
            span = torch.arange(width * bs, device=self.device)
            mask = (span[None, :] < lengths[:, None])[None, :, None, :]
        prefill_specs: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] = []
        for c in prefills:
            first = len(ids)
            end = c.start + c.num_tokens
            ids += c.seq.token_ids[c.start:end]
            positions += range(c.start, end)
            slots += self._slots(c.seq, c.start, end)
            table = causal = None
            if c.start:
                table = self._tensor(c.seq.block_table[: -(-end // bs)])
                q_pos = torch.arange(c.start, end, device=self.device)
                causal = torch.arange(end, device=self.device)[None, :] <= q_pos[:, None]
            prefill_specs.append((first, c.num_tokens, c.start, table, causal))
            if c.samples:
                logits_at.append(len(ids) - 1)
        batch = AttentionBatch(
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            num_decode=len(decodes),
            decode_block_tables=tables,
            decode_mask=mask,
            prefills=prefill_specs,
            logits_indices=self._tensor(logits_at),
        )
        return self._tensor(ids), batch

    def execute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[int],
                                                     list[TokenLogprob | None]]:
        """Run the forward for the scheduled chunks and sample; returns (seqs, tokens, logprobs)."""
        chunks = sorted(out.chunks, key=lambda c: c.num_tokens > 1)
        input_ids, batch = self.prepare(chunks)
        logits = self.model.forward(input_ids, batch, self.pool.k, self.pool.v)
        sampled = [c.seq for c in chunks if c.samples]
        tokens, logprobs = sample(logits, sampled)
        return sampled, tokens, logprobs


def _pad(values: list[int], width: int) -> list[int]:
    return values + [0] * (width - len(values))
