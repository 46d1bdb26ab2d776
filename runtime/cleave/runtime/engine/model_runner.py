"""Turns a scheduler step into one forward over the paged pool, then samples.

The forward computes logits only at the rows it is told: one per sampled sequence, and, for a
request that asked for prompt logprobs, one per prompt position of its chunk not scored yet
(after the sampled rows, so a step where nobody asks is exactly as before).
"""

from __future__ import annotations

import torch

from cleave.runtime.engine.dense.graphs import DecodeGraphs
from cleave.runtime.engine.kv_pool import KVPool
from cleave.runtime.engine.paged_model import AttentionBatch, DecodeGroup, PagedModel
from cleave.runtime.engine.sampler import prompt_logprobs, sample
from cleave.runtime.engine.scheduler import ScheduledChunk, SchedulerOutput
from cleave.runtime.engine.sequence import Sequence, TokenLogprob

# Per scoring sequence, the prompt positions whose logits follow the sampled rows.
Scored = list[tuple[Sequence, range]]


class ModelRunner:
    def __init__(self, model: PagedModel, pool: KVPool, graphs: DecodeGraphs | None = None
                 ) -> None:
        self.model = model
        self.pool = pool
        self.graphs = graphs
        self.block_size = pool.block_size
        self.device = model.device

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, chunks: list[ScheduledChunk]
                ) -> tuple[torch.Tensor, AttentionBatch, list[Sequence], Scored]:
        """Flatten a step into model inputs; also returns the sequences in logits-row order,
        then the prompt positions scored in the rows after theirs."""
        bs = self.block_size
        # Decodes sorted by context length, so each width group is a contiguous run.
        # (A one-token chunk that does not reach the end is a prefill cut by the budget.)
        decodes = sorted((c for c in chunks if c.num_tokens == 1 and c.samples),
                         key=lambda c: c.start)
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.samples)]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_at: list[int] = []
        sampled: list[Sequence] = []
        scored: Scored = []
        score_at: list[int] = []
        for c in decodes:
            sampled.append(c.seq)
            logits_at.append(len(ids))
            ids.append(c.seq.token_ids[c.start])
            positions.append(c.start)
            slots += self._slots(c.seq, c.start, c.start + 1)
        groups: list[DecodeGroup] = []
        widths = [-(-(c.start + 1) // bs) for c in decodes]
        for lo, hi in group_by_width(widths, bs):
            width = widths[hi - 1]
            members = decodes[lo:hi]
            tables = torch.tensor([_pad(c.seq.block_table[:width], width) for c in members],
                                  dtype=torch.long, device=self.device)
            lengths = self._tensor([c.start + 1 for c in members])
            span = torch.arange(width * bs, device=self.device)
            mask = (span[None, :] < lengths[:, None])[None, :, None, :]
            groups.append(DecodeGroup(lo, hi - lo, tables, mask, lengths))
        prefill_specs: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] = []
        for c in prefills:
            first = len(ids)
            end = c.start + c.num_tokens
            ids += c.seq.token_ids[c.start:end]
            positions += range(c.start, end)
            slots += self._slots(c.seq, c.start, end)
            causal = None
            table = self._tensor(c.seq.block_table[: -(-end // bs)])
            if c.start:
                q_pos = torch.arange(c.start, end, device=self.device)
                causal = torch.arange(end, device=self.device)[None, :] <= q_pos[:, None]
            prefill_specs.append((first, c.num_tokens, c.start, table, causal))
            positions_scored = c.seq.prompt_positions(c.start, end)
            if positions_scored:
                scored.append((c.seq, positions_scored))
                score_at += [first + p - c.start for p in positions_scored]
            if c.samples:
                sampled.append(c.seq)
                logits_at.append(len(ids) - 1)
        batch = AttentionBatch(
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            decode_groups=groups,
            prefills=prefill_specs,
            logits_indices=self._tensor(logits_at + score_at),
        )
        return self._tensor(ids), batch, sampled, scored

    def execute(self, out: SchedulerOutput) -> tuple[
            list[Sequence], list[int], list[TokenLogprob | None],
            list[tuple[Sequence, list[TokenLogprob]]]]:
        """Run the forward for the scheduled chunks and sample; returns (seqs, tokens,
        logprobs, and each scoring sequence's new prompt logprobs)."""
        shape = None if self.graphs is None else self.graphs.shape_for(out.chunks)
        scored: Scored = []  # decode-only steps (the graphs' kind) score no prompt
        if shape is not None and self.graphs is not None:
            logits, sampled = self.graphs.run(out.chunks, shape)
        else:
            input_ids, batch, sampled, scored = self.prepare(out.chunks)
            logits = self.model.forward(input_ids, batch, self.pool.k, self.pool.v)
        if not scored:
            return (sampled, *sample(logits, sampled), [])
        row = len(sampled)
        scores = []
        for seq, positions in scored:
            n = len(positions)
            targets = seq.token_ids[positions.start + 1:positions.stop + 1]
            assert seq.params.prompt_logprobs is not None
            scores.append((seq, prompt_logprobs(logits[row:row + n], targets,
                                                seq.params.prompt_logprobs)))
            row += n
        return (sampled, *sample(logits[:len(sampled)], sampled), scores)


# Fixed cost of one more attention group (about a dozen ops per layer), in padded tokens it
# would take to cost as much; measured on SmolLM2-135M, one CPU thread.
GROUP_OVERHEAD_TOKENS = 1024


def group_by_width(widths: list[int], block_size: int,
                   overhead_tokens: int = GROUP_OVERHEAD_TOKENS) -> list[tuple[int, int]]:
    """Split ascending block-table widths into runs that minimise padded work.

    A batched decode attention pads every sequence to its group's widest; one group per
    sequence pays fixed per-op overhead instead. Dynamic programming over split points
    weighs the two: cost(group) = members * widest * block_size + overhead_tokens.
    """
    n = len(widths)
    best = [0] + [0] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        best[end], cut[end] = min(
            (best[start] + (end - start) * widths[end - 1] * block_size + overhead_tokens, start)
            for start in range(end))
    spans: list[tuple[int, int]] = []
    end = n
    while end:
        spans.append((cut[end], end))
        end = cut[end]
    return spans[::-1]


def _pad(values: list[int], width: int) -> list[int]:
    return values + [0] * (width - len(values))
