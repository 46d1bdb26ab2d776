"""What the native kernels are handed and trust: layer.c's weight-address structure, a step's
pool indices, and the checks run before any C reads them (the kernels index memory with
them unchecked)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_P, _L = ctypes.c_void_p, ctypes.c_long


class LayerArgs(ctypes.Structure):
    """layer.c's ``layer_t``: a layer's sizes and the addresses of its bf16 weights."""

    _fields_ = [("hidden", _L), ("nq", _L), ("nkv", _L), ("d", _L), ("inter", _L),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("in_norm", _P), ("qkv", _P), ("qkv_bias", _P), ("o", _P), ("o_bias", _P),
                ("post_norm", _P), ("gate_up", _P), ("down", _P)]

    def scratch_words(self, rows: int) -> int:
        """bf16 elements of ``step_layer_bf16``'s scratch for ``rows`` tokens: the normed
        input, qkv, the attention output and the activation (layer.c's bbuf)."""
        nq, nkv, d = int(self.nq), int(self.nkv), int(self.d)  # ctypes fields read as Any
        return rows * (int(self.hidden) + (nq + 2 * nkv) * d + nq * d + int(self.inter))


def check_indices(tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                  *others: torch.Tensor) -> None:
    """What the attention kernels trust: int64 indices (tables, lengths and any ``others``,
    e.g. slots) and no length past its table, whose width sizes their scratch."""
    if any(t.dtype != torch.int64 for t in (tables, lengths, *others)):
        raise ValueError("native attention: block tables, lengths and slots must be int64")
    if lengths.numel() and int(lengths.max()) > tables.shape[1] * block_size:
        raise ValueError("native attention: a length runs past its block table")


@dataclass(frozen=True)
class StepIndex:
    """Where a step's rows read and write the pool, as :meth:`Kernels.step_layer` takes it
    (with the scratch :meth:`Kernels.step_scratch` sizes after :func:`check_step`)."""

    slots: torch.Tensor  # [rows]: each row's new KV slot
    tables: torch.Tensor  # [decodes, width]: the decode rows' (the first rows) block tables
    lengths: torch.Tensor  # [decodes]: their keys, the new one included
    spans: torch.Tensor  # [chunks, 3]: each prefill chunk's first row, length and context
    chunk_tables: torch.Tensor  # [chunks, width]: their block tables, zero-padded


def decode_scratch(group: int, width: int, block_size: int) -> int:
    """Floats of decode_attention_bf16's scratch: a kv head's group of query heads' scores
    over the widest table."""
    return group * width * block_size


def stack_tables(tables: list[torch.Tensor], keys: list[int],
                 block_size: int) -> torch.Tensor:
    """Block tables (each ``[n, width]`` or ``[width]``) as one zero-padded ``[rows, widest]``
    int64 table, each first checked to hold its ``keys`` (the padding would hide a short
    one: the kernel would read block 0)."""
    for table, need in zip(tables, keys, strict=True):
        if need > table.shape[-1] * block_size:
            raise ValueError("native step: a decode or chunk runs past its block table")
    rows = [t.view(-1, t.shape[-1]) for t in tables]
    width = max((t.shape[1] for t in rows), default=0)
    if not rows:
        return torch.zeros(0, 0, dtype=torch.int64)
    return torch.cat([F.pad(t, (0, width - t.shape[1])) for t in rows]).contiguous()


def check_step(index: StepIndex, rows: int, blocks: int, block_size: int) -> int:
    """What the step kernel trusts, checked once a step: int64 contiguous indices, one slot a
    row and every slot and block id inside the pool of ``blocks``, the decodes then the
    chunks tiling the rows in order, none past its table. Returns the most keys a chunk
    attends over (what its scratch is sized by)."""
    slots, tables, lengths, spans, chunk_tables = (index.slots, index.tables, index.lengths,
                                                   index.spans, index.chunk_tables)
    check_indices(tables, lengths, block_size, slots, spans, chunk_tables)
    if any(not t.is_contiguous() for t in (slots, tables, lengths, spans, chunk_tables)):
        raise ValueError("native step: indices must be contiguous")
    if (slots.shape != (rows,) or tables.shape[0] != lengths.numel() or spans.dim() != 2
            or spans.shape[1] != 3 or chunk_tables.shape[0] != spans.shape[0]):
        raise ValueError(f"native step: {rows} rows, slots {tuple(slots.shape)}, tables "
                         f"{tuple(tables.shape)} for {lengths.numel()} decodes, spans "
                         f"{tuple(spans.shape)}, chunk tables {tuple(chunk_tables.shape)}")
    for ids, limit, what in ((slots, blocks * block_size, "slot"), (tables, blocks, "block"),
                             (chunk_tables, blocks, "block"), (lengths, None, "length")):
        if ids.numel():
            low, high = (int(x) for x in torch.aminmax(ids))
            if low < 0 or (limit is not None and high >= limit):
                raise ValueError(f"native step: a {what} outside [0, {limit}): {low}..{high}")
    first, most = lengths.numel(), 0
    for start, length, context in spans.tolist():
        if start != first or length <= 0 or context < 0:
            raise ValueError(f"native step: chunk ({start}, {length}, {context}) does not "
                             f"start at row {first}")
        if context + length > chunk_tables.shape[1] * block_size:
            raise ValueError("native step: a chunk runs past its block table")
        first, most = first + length, max(most, context + length)
    if first != rows:
        raise ValueError(f"native step: decodes and chunks cover {first} of {rows} rows")
    return most
