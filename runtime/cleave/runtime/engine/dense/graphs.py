"""Decode steps replayed as CUDA graphs, without per-step Python or kernel-launch overhead.

A step whose chunks are all decodes runs at a fixed shape: the batch padded up to a bucket of
sequences and every block table padded up to a bucket of blocks, the inputs copied into that
bucket's static buffers. On CUDA each bucket's forward is captured once (the first time a step
needs it) and then replayed; elsewhere (``decode_graphs="on"`` on the CPU) the same fixed-shape
forward runs eagerly, which is how the tests and ``bench/gpu.sh --dry-run`` check the padding and
the masks without a GPU. Padded rows attend only to one key (length 1) and write their K/V into a
scratch block the block manager never hands out. Prefills, mixed steps and batches larger than
any bucket take the ordinary path. Mixture-of-experts layers read per-expert counts on the host,
which a graph cannot, so those models (and tensor-parallel ranks) never use graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from cleave.runtime.engine.paged_model import AttentionBatch, DecodeGroup, PagedModel
from cleave.runtime.engine.scheduler import ScheduledChunk
from cleave.runtime.engine.sequence import Sequence

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Padded context tokens a bucket may gather per layer; wider steps run eagerly instead (a graph's
# gathered KV stays allocated in the graphs' memory pool).
MAX_GRAPH_TOKENS = 1 << 16


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass
class _Bucket:
    """One (batch, width) shape's static inputs, and on CUDA its graph and output."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor  # logits rows: every padded row (the caller keeps the real ones)
    span: torch.Tensor  # token offsets within a padded table
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    uses: int = field(default=0)


class DecodeGraphs:
    def __init__(self, model: PagedModel, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor],
                 block_size: int, scratch_block: int, max_blocks: int, capture: bool) -> None:
        self.model = model
        self.k_pool, self.v_pool = k_pool, v_pool
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        widths, w = [], 1
        while w < max_blocks:
            widths.append(w)
            w *= 2
        self.width_buckets = (*widths, max_blocks)
        self.capture = capture
        self.device = model.device
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._mempool: Any = None  # the graphs share one memory pool (replayed one at a time)
        self.steps = 0  # steps this ran (the tests check it is used)

    def shape_for(self, chunks: list[ScheduledChunk]) -> tuple[int, int] | None:
        """The (batch, width) bucket of a decode-only step, or None: run it the ordinary way."""
        if not chunks or not all(c.num_tokens == 1 and c.samples for c in chunks):
            return None
        batch = _bucket(len(chunks), BATCH_BUCKETS)
        blocks = max(-(-(c.start + 1) // self.block_size) for c in chunks)
        width = _bucket(blocks, self.width_buckets)
        if batch is None or width is None or batch * width * self.block_size > MAX_GRAPH_TOKENS:
            return None
        return batch, width

    def run(self, chunks: list[ScheduledChunk], shape: tuple[int, int]
            ) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits for ``chunks`` (all decodes) and the sequences in logits-row order."""
        batch, width = shape
        chunks = sorted(chunks, key=lambda c: c.start)  # the ordinary path's row order
        bucket = self._buckets.get(shape) or self._new_bucket(batch, width)
        n, pad = len(chunks), batch - len(chunks)
        bs = self.block_size
        tables = [(c.seq.block_table[:width] + [0] * width)[:width] for c in chunks]
        # One host-to-device copy per buffer; padded rows: token 0 at position 0, one key,
        # written to the scratch slot.
        self._fill(bucket.input_ids, [c.seq.token_ids[c.start] for c in chunks] + [0] * pad)
        self._fill(bucket.positions, [c.start for c in chunks] + [0] * pad)
        self._fill(bucket.slots, [c.seq.block_table[c.start // bs] * bs + c.start % bs
                                  for c in chunks] + [self.scratch_slot] * pad)
        self._fill(bucket.lengths, [c.start + 1 for c in chunks] + [1] * pad)
        self._fill(bucket.tables, tables + [[0] * width] * pad)
        self.steps += 1
        bucket.uses += 1
        if self.capture and bucket.graph is None:
            try:
                self._capture(bucket)
            except RuntimeError as e:  # e.g. out of memory: serve eagerly rather than fail
                self.capture = False
                log.warning("decode graph capture failed (%s); decoding without graphs", e)
        if bucket.graph is not None:
            bucket.graph.replay()
            assert bucket.logits is not None
            logits = bucket.logits
        else:
            logits = self._forward(bucket)
        return logits[:n], [c.seq for c in chunks]

    def _fill(self, buffer: torch.Tensor, values: list[int] | list[list[int]]) -> None:
        buffer.copy_(torch.tensor(values, dtype=buffer.dtype))

    def _new_bucket(self, batch: int, width: int) -> _Bucket:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=self.device)

        bucket = _Bucket(input_ids=longs(batch), positions=longs(batch), slots=longs(batch),
                         tables=longs(batch, width), lengths=longs(batch),
                         rows=torch.arange(batch, device=self.device),
                         span=torch.arange(width * self.block_size, device=self.device))
        self._buckets[(batch, width)] = bucket
        return bucket

    def _forward(self, b: _Bucket) -> torch.Tensor:
        """The fixed-shape forward; a fresh batch each time, so no mask outlives its step."""
        mask = (b.span[None, :] < b.lengths[:, None])[None, :, None, :]
        group = DecodeGroup(0, b.input_ids.shape[0], b.tables, mask, b.lengths)
        batch = AttentionBatch(positions=b.positions, slot_mapping=b.slots,
                               decode_groups=[group], prefills=[], logits_indices=b.rows)
        return self.model.forward(b.input_ids, batch, self.k_pool, self.v_pool)

    def _capture(self, b: _Bucket) -> None:
        # Warm up on a side stream (allocator and kernel selection settle), then capture. The
        # buffers hold this step's real inputs: warm-up and replay write the same K/V twice.
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            b.logits = self._forward(b)
        self._mempool = graph.pool()
        b.graph = graph
