"""A linear layer that picks, per call, the fastest kernel measured for its shape.

- bf16 on a CPU with AVX512-BF16, up to ``NATIVE_MAX_ROWS`` rows (decode): the native kernel
  (native/linear.c), which streams the row-major weights at the core's read bandwidth where
  oneDNN's bf16 inner product reached a third of it (bench/linear_micro.py). Its outputs match
  oneDNN's bit for bit but for the order of fp32 sums (over 99.9 % of elements identical).
- More rows (prefill) on the same weights: ``F.linear`` (oneDNN), compute-bound there, where it
  ties with a prepacked weight; keeping one row-major copy serves both.
- bf16 on a CPU whose oneDNN takes packed bf16 but without the native kernels (no compiler,
  ``CLEAVE_NATIVE_KERNELS=0``): weights reordered once, at load, into oneDNN's blocked layout
  (``Tensor.to_mkldnn``, run by ``mkldnn._linear_pointwise``, as Inductor's CPU freezing
  emits), 1.3-1.7x ``F.linear`` in decode with the same bits.
- Elsewhere (fp32, whose token identity with transformers the tests pin; CUDA; AVX2 only;
  more than one torch thread, which the native kernels do not use): ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cleave.runtime.engine.native.kernels import Kernels, kernels

# Above this many rows oneDNN's compute-bound kernel wins (bench/linear_micro.py's crossover).
NATIVE_MAX_ROWS = 32


def cpu_packs_bf16() -> bool:
    """Whether this CPU's oneDNN runs bf16 inner products on packed weights (AVX512-BF16 or
    AMX; the check Inductor's CPU freezing makes before it emits the same op)."""
    return bool(torch._C._has_mkldnn) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packs(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is prepacked: bf16 on a CPU whose oneDNN takes packed bf16."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and cpu_packs_bf16())


def native_for(weight: torch.Tensor) -> Kernels | None:
    """The native kernels when they run this weight, else None."""
    return kernels() if Kernels.takes_linear(weight) else None


class Linear:
    """``x @ weight.T + bias`` for ``x [tokens, in]``. ``prepack=False`` keeps the weight as
    given where it would be reordered for oneDNN (the LM head: tied to the embeddings it must
    stay row-major for the lookup, and prepacked it gained nothing measurable)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prepack: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self._nbytes = weight.numel() * weight.element_size() + (
            0 if bias is None else bias.numel() * bias.element_size())
        self.bias = bias
        self.native = native_for(weight)
        self.packed = prepack and self.native is None and packs(weight)
        self.weight = weight.contiguous().to_mkldnn() if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.shape[0] <= NATIVE_MAX_ROWS:
            return self.native.linear(x, self.weight, self.bias)
        if self.packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.weight, self.bias, "none", [], "")
            return out
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return self._nbytes
