"""ctypes bindings of the native kernels (gemm.c, attention.c, prefill.c, layer.c), loaded once
per process."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from cleave.runtime.engine.native.args import (
    LayerArgs,
    StepIndex,
    check_indices,
    check_step,
    decode_scratch,
)
from cleave.runtime.engine.native.build import Built, build

log = logging.getLogger(__name__)

_P, _L = ctypes.c_void_p, ctypes.c_long
PANEL = 64  # gemm.c's NP: outputs a panel of a packed weight


class Kernels:
    """The loaded library. Callers check :meth:`takes_linear` before :meth:`pack`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._packed_linear = lib.packed_linear_bf16
        self._packed_linear.argtypes = [_P, _L, _P, _P, _P, _L, _L, _L, _L, ctypes.c_int]
        self._packed_linear.restype = None
        self._attention = lib.decode_attention_bf16
        self._attention.argtypes = [_P, _L, _P, _P, _L, _L, _P, _L, _P, _L, _L, _L, _L,
                                    ctypes.c_float, _P, _P]
        self._attention.restype = None
        self._layer = lib.step_layer_bf16
        self._layer.argtypes = [ctypes.POINTER(LayerArgs), _P, _L, _P, _P, _P, _P, _L, _L, _P,
                                _L, _P, _L, _P, _L, _P, _P, _L, _P, _P]
        self._layer.restype = None
        self._prefill = lib.prefill_attention_bf16
        self._prefill.argtypes = [_P, _L, _P, _P, _L, _L, _P, _L, _L, _L, _L, _L,
                                  ctypes.c_float, _P, _P]
        self._prefill.restype = None
        self._prefill_scratch = lib.prefill_attention_scratch
        self._prefill_scratch.argtypes = [_L, _L]
        self._prefill_scratch.restype = _L
        self._rms_norm = lib.rms_norm_bf16
        self._rms_norm.argtypes = [_P, _P, _P, _L, _L, ctypes.c_float]
        self._rms_norm.restype = None
        self._rotary = lib.rotary_bf16
        self._rotary.argtypes = [_P, _L, _L, _L, _L, _P, _P]
        self._rotary.restype = None
        self._argmax = lib.argmax_f32
        self._argmax.argtypes = [_P, _L, _L, _P]
        self._argmax.restype = None

    @staticmethod
    def takes_linear(weight: torch.Tensor) -> bool:
        """Whether :meth:`pack` takes this weight: bf16 on the CPU, row-major, and an input
        width of whole 32-element vectors (gemm.c steps by pairs; the step layer's other
        kernels and the tests assume the wider step)."""
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] % 32 == 0)

    @staticmethod
    def pack(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """A row-major ``weight [out, in]`` (:meth:`takes_linear`) in gemm.c's panels,
        ``[ceil(out / 64), in / 2, 64, 2]``, zero rows padding the last panel. ``gated``: a
        gated MLP's ``[gate; up]`` (``out % 64 == 0``), each panel 32 rows of gate then the
        32 matching rows of up, for :meth:`packed_linear`'s ``silu``."""
        out_features, width = weight.shape
        if gated:
            if out_features % PANEL:
                raise ValueError(f"pack: a gated weight of {out_features} rows is no whole "
                                 f"number of {PANEL}-row panels")
            weight = weight.view(2, -1, PANEL // 2, width).transpose(0, 1).reshape(
                out_features, width)
        padded = torch.nn.functional.pad(weight, (0, 0, 0, -out_features % PANEL))
        return padded.view(-1, PANEL, width // 2, 2).transpose(1, 2).contiguous()

    @staticmethod
    def rows(packed: torch.Tensor, ids: torch.Tensor, out_features: int) -> torch.Tensor:
        """Rows ``ids`` of the weight :meth:`pack` packed, ``[*ids.shape, in]`` (a tied LM
        head's embedding lookup, as F.embedding); ids past ``out_features`` raise, as its
        do."""
        if ids.numel():
            low, high = torch.aminmax(ids)
            if not 0 <= int(low) <= int(high) < out_features:
                raise IndexError(f"token ids must be in [0, {out_features})")
        return packed[ids // PANEL, :, ids % PANEL].reshape(*ids.shape, 2 * packed.shape[1])

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                      bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``x [rows, in]`` (bf16), ``packed`` = :meth:`pack`
        (weight) of a weight with ``out_features`` rows; any row count (gemm.c). ``silu``:
        ``packed`` = :meth:`pack` (gate_up, gated=True), and the result is ``silu(gate) *
        up``, ``out_features`` (the intermediate size) wide, rounded as torch's bf16 ops."""
        panels, half, panel, _ = packed.shape
        rows_packed = 2 * out_features if silu else out_features
        if (panel != PANEL or panels != -(-rows_packed // PANEL) or not packed.is_contiguous()
                or packed.dtype != torch.bfloat16
                or (silu and (rows_packed % PANEL or bias is not None))):
            raise ValueError(f"packed_linear: {tuple(packed.shape)} {packed.dtype} is no "
                             f"packing of {rows_packed} outputs"
                             f"{' (gated, unbiased)' if silu else ''}")
        if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.bfloat16):
            raise ValueError(f"packed_linear: bias {tuple(bias.shape)} {bias.dtype} for "
                             f"{out_features} bf16 outputs")
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != 2 * half:
            raise ValueError(f"packed_linear: x {tuple(x.shape)} {x.dtype} stride "
                             f"{x.stride()} against weight {tuple(packed.shape)}")
        y = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
        bias = None if bias is None else bias.contiguous()  # held until the call returns
        self._packed_linear(x.data_ptr(), x.stride(0), packed.data_ptr(),
                            None if bias is None else bias.data_ptr(), y.data_ptr(),
                            out_features, x.shape[0], out_features, 2 * half, int(silu))
        return y

    @staticmethod
    def takes_head_dim(head_dim: int) -> bool:
        """Head widths the attention and rotary kernels run: whole 32-element steps, halves
        of whole 16-lane vectors, at most 256 (their per-head buffers)."""
        return head_dim % 32 == 0 and head_dim <= 256

    @staticmethod
    def takes_decode_attention(num_heads: int, num_kv_heads: int, head_dim: int,
                               dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the attention kernels (decode and prefill) run this model (bf16 pool on
        the CPU)."""
        return (device.type == "cpu" and dtype == torch.bfloat16
                and Kernels.takes_head_dim(head_dim) and num_heads % num_kv_heads == 0)

    def decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         tables: torch.Tensor, lengths: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """One query per sequence, ``q [seqs, nq, d]``, over the first ``lengths[s]`` keys of
        its blocks ``tables [seqs, width]`` (int64) in ``k_pool``/``v_pool [nkv, blocks, bs,
        d]``; returns ``[seqs, nq, d]``."""
        seqs, nq, d = q.shape
        nkv, blocks, bs, _ = k_pool.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        check_indices(tables, lengths, bs)
        tables, lengths = tables.contiguous(), lengths.contiguous()
        scratch = torch.empty(decode_scratch(nq // nkv, tables.shape[1], bs),
                              dtype=torch.float32)
        out = torch.empty(seqs, nq, d, dtype=torch.bfloat16)
        self._attention(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                        blocks, bs, tables.data_ptr(), tables.shape[1], lengths.data_ptr(),
                        seqs, nq, nkv, d, scale, scratch.data_ptr(), out.data_ptr())
        return out

    def prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          table: torch.Tensor, context: int, scale: float) -> torch.Tensor:
        """Causal attention of a chunk's queries ``q [len, nq, d]`` at positions
        ``context..`` over its keys in the pool (its own already written), through its block
        ``table`` (int64); returns ``[len, nq, d]``."""
        length, nq, d = q.shape
        nkv, blocks, bs, _ = k_pool.shape
        if not Kernels.takes_decode_attention(nq, nkv, d, k_pool.dtype, k_pool.device):
            raise ValueError(f"prefill_attention: {nq} heads over {nkv}, head_dim {d}, "
                             f"{k_pool.dtype} on {k_pool.device}")
        out = torch.empty(length, nq, d, dtype=torch.bfloat16)
        if length == 0:
            return out
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        table = table.contiguous()
        if table.dtype != torch.int64 or table.numel() * bs < context + length:
            raise ValueError(f"prefill_attention: block table {table.dtype} "
                             f"[{table.numel()}] cannot hold {context + length} keys")
        scratch = torch.empty(self._prefill_scratch(context + length, d), dtype=torch.float32)
        self._prefill(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), blocks,
                      bs, table.data_ptr(), context, length, nq, nkv, d, scale,
                      scratch.data_ptr(), out.data_ptr())
        return out

    @staticmethod
    def takes_rows(x: torch.Tensor, width: int) -> bool:
        """Whether the row kernels (norm, rotary) take ``x``: bf16 on the CPU,
        2-D and contiguous, a width of whole 16-lane vectors."""
        return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2
                and x.is_contiguous() and width % 16 == 0)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * bf16(x * rsqrt(mean(x^2) + eps))`` per row of ``x [rows, n]``
        (Llama's rounding, norms.py)."""
        rows, n = x.shape
        y = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, n, eps)
        return y

    def rotary_(self, x: torch.Tensor, heads: int, d: int, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
        """Rotates the first ``heads`` heads of each row of ``x [rows, >= heads * d]`` in
        place by ``cos``/``sin [rows, d]`` (sin sign-folded, rotary.py)."""
        if not Kernels.takes_head_dim(d) or x.stride(1) != 1:
            raise ValueError(f"rotary: head_dim {d}, x stride {x.stride()}")
        cos, sin = cos.contiguous(), sin.contiguous()  # held until the call returns
        self._rotary(x.data_ptr(), x.shape[0], x.stride(0), heads, d, cos.data_ptr(),
                     sin.data_ptr())

    @staticmethod
    def takes_argmax(logits: torch.Tensor) -> bool:
        """Whether :meth:`argmax` takes ``logits``: fp32 rows on the CPU, contiguous."""
        return (logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.dim() == 2 and logits.shape[1] > 0 and logits.is_contiguous())

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """``logits.argmax(dim=-1).tolist()`` (first largest, or first NaN) for
        :meth:`takes_argmax` logits."""
        idx = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], idx.data_ptr())
        return idx.tolist()

    def step_layer(self, args: LayerArgs, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   index: StepIndex, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """One layer's forward over ``h [rows, hidden]`` in place, the step's decodes and
        prefill chunks alike; ``cos``/``sin`` ``[rows, d]``; ``scratch`` and the checked
        ``index`` from :meth:`step_scratch` for these rows and this pool's shape."""
        _, blocks, bs, _ = k_pool.shape
        fbuf, bbuf = scratch
        self._layer(ctypes.byref(args), h.data_ptr(), h.shape[0], cos.data_ptr(), sin.data_ptr(),
                    k_pool.data_ptr(), v_pool.data_ptr(), blocks, bs, index.slots.data_ptr(),
                    index.lengths.numel(), index.tables.data_ptr(), index.tables.shape[1],
                    index.lengths.data_ptr(), index.spans.shape[0], index.spans.data_ptr(),
                    index.chunk_tables.data_ptr(), index.chunk_tables.shape[1],
                    fbuf.data_ptr(), bbuf.data_ptr())

    def step_scratch(self, args: LayerArgs, index: StepIndex, rows: int,
                     k_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checks ``index`` for ``rows`` over ``k_pool``'s shape (:func:`check_step`) and
        returns :meth:`step_layer`'s scratch: fp32 for the largest attention call, bf16
        ``args.scratch_words(rows)``."""
        _, blocks, bs, _ = k_pool.shape
        keys = check_step(index, rows, blocks, bs)
        group, d = int(args.nq) // int(args.nkv), int(args.d)
        floats = max(decode_scratch(group, index.tables.shape[1], bs),
                     int(self._prefill_scratch(keys, d)) if keys else 0)
        return (torch.empty(floats, dtype=torch.float32),
                torch.empty(args.scratch_words(rows), dtype=torch.bfloat16))


@functools.cache
def _library() -> Kernels | None:
    built = build()
    if built.path is not None:
        try:
            return Kernels(ctypes.CDLL(str(built.path)))
        except OSError as e:  # e.g. a cache on a noexec mount
            built = Built(None, f"could not load {built.path}: {e}")
    log.info("native kernels off: %s; stock torch kernels run instead", built.reason)
    return None


def kernels() -> Kernels | None:
    """The native kernels, or None (logged once, with the reason) where they cannot run. They
    run one thread: with more torch threads (EngineConfig.num_threads) torch's own kernels,
    which use them all, are chosen instead."""
    if torch.get_num_threads() != 1:
        _note_threads(torch.get_num_threads())
        return None
    return _library()


@functools.cache
def _note_threads(threads: int) -> None:
    log.info("native kernels off: %d torch threads (they run one); torch's kernels run",
             threads)
