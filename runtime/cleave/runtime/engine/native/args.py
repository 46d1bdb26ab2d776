"""What the native kernels are handed and trust: layer.c's weight-address structure, a step's
pool indices, and the checks run before any C reads them (the kernels index memory with
them unchecked)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

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
    (built by :meth:`Kernels.step_index`): every index contiguous int64."""

    slots: torch.Tensor  # [rows]: each row's new KV slot
    tables: torch.Tensor  # [decodes, width]: the decode rows' (the first rows) block tables
    lengths: torch.Tensor  # [decodes]: their keys, the new one included
    spans: torch.Tensor  # [chunks, 3]: each prefill chunk's first row, length and context
    chunk_tables: torch.Tensor  # [chunks, width]: their block tables, zero-padded
    fbuf: torch.Tensor  # fp32 attention scratch: the most any one call takes


def check_step(slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
               spans: torch.Tensor, chunk_tables: torch.Tensor, block_size: int) -> None:
    """What the step kernel trusts: the decodes, then the chunks in order, tile the rows (one
    slot each), and no decode or chunk runs past its block table."""
    check_indices(tables, lengths, block_size, slots, spans, chunk_tables)
    if any(not t.is_contiguous() for t in (slots, tables, lengths, spans, chunk_tables)):
        raise ValueError("native step: indices must be contiguous")
    first = lengths.numel()
    for start, length, context in spans.tolist():
        if start != first or length <= 0 or context < 0:
            raise ValueError(f"native step: chunk ({start}, {length}, {context}) does not "
                             f"start at row {first}")
        if context + length > chunk_tables.shape[1] * block_size:
            raise ValueError("native step: a chunk runs past its block table")
        first += length
    if first != slots.numel():
        raise ValueError(f"native step: decodes and chunks cover {first} of "
                         f"{slots.numel()} rows")
