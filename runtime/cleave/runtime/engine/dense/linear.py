"""A linear layer that picks the fastest kernel measured for its weight.

- bf16 on a CPU with AVX512-BF16: the weight packed once, at load, into the native GEMM's
  panels (native/gemm.c), which runs every row count: it streams decode's weights faster than
  a row-major GEMV did and beats oneDNN in prefill (bench/linear_micro.py), so one packed copy
  serves both. Its outputs match oneDNN's bit for bit but for the order of fp32 sums. A tied
  LM head is packed too: the embedding lookup reads its rows out of the panels
  (:meth:`Linear.lookup`), so no row-major copy is kept.
- bf16 on a CPU whose oneDNN takes packed bf16 but without the native kernels (no compiler,
  ``CLEAVE_NATIVE_KERNELS=0``): weights reordered once, at load, into oneDNN's blocked layout
  (``Tensor.to_mkldnn``, run by ``mkldnn._linear_pointwise``, as Inductor's CPU freezing
  emits), 1.3-1.7x ``F.linear`` in decode with the same bits; not for the LM head, whose rows
  a tied model looks up.
- Elsewhere (fp32, whose token identity with transformers the tests pin; CUDA; AVX2 only;
  more than one torch thread, which the native kernels do not use): ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cleave.runtime.engine.native.kernels import PANEL, Kernels, kernels


def cpu_packs_bf16() -> bool:
    """Whether this CPU's oneDNN runs bf16 inner products on packed weights (AVX512-BF16 or
    AMX; the check Inductor's CPU freezing makes before it emits the same op)."""
    return bool(torch._C._has_mkldnn) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packs(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is prepacked for oneDNN: bf16 on a CPU whose oneDNN takes packed
    bf16."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and cpu_packs_bf16())


def native_for(weight: torch.Tensor) -> Kernels | None:
    """The native kernels when they run this weight, else None."""
    return kernels() if Kernels.takes_linear(weight) else None


class Linear:
    """``x @ weight.T + bias`` for ``x [tokens, in]``. ``prepack=False`` keeps oneDNN's layout
    out (the LM head: tied to the embeddings its rows are looked up, and that layout gained
    nothing measurable there). ``silu_and_mul``: ``weight`` is a gated MLP's ``[gate; up]``
    with a SiLU activation, to fuse ``silu(gate) * up`` into the native GEMM where it can
    (``fused``: the native kernels run, no bias, halves of whole 32-row steps); the result is
    then the activation, otherwise the caller applies it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prepack: bool = True, silu_and_mul: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.native = native_for(weight)
        self.packed = prepack and self.native is None and packs(weight)  # oneDNN's layout
        self.fused = (silu_and_mul and self.native is not None and bias is None
                      and self.out_features % PANEL == 0)
        if self.native is not None:
            self.weight = Kernels.pack(weight, gated=self.fused)
        elif self.packed:
            self.weight = weight.contiguous().to_mkldnn()
        else:
            self.weight = weight
        self._nbytes = weight.numel() * weight.element_size() + (
            0 if bias is None else bias.numel() * bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            assert self.native is not None
            return self.native.packed_linear(x, self.weight, self.out_features // 2, silu=True)
        if self.native is not None:
            return self.native.packed_linear(x, self.weight, self.out_features, self.bias)
        if self.packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.weight, self.bias, "none", [], "")
            return out
        return F.linear(x, self.weight, self.bias)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, ``[*ids.shape, in]``: a tied LM head's embeddings."""
        if self.packed or self.fused:
            raise ValueError("Linear.lookup: oneDNN's layout (or a gated packing) has no rows "
                             "to look up (build a looked-up weight with prepack=False)")
        if self.native is not None:
            return Kernels.rows(self.weight, ids, self.out_features)
        return F.embedding(ids, self.weight)

    def nbytes(self) -> int:
        return self._nbytes
