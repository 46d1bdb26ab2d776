"""A linear layer whose bf16 weights on the CPU are prepacked for oneDNN once, at load.

``F.linear`` hands oneDNN a plain row-major weight on every call; a weight reordered once into
oneDNN's own blocked layout (``Tensor.to_mkldnn``, run by ``mkldnn._linear_pointwise``, which is
what Inductor's CPU freezing emits too) gives bit-identical outputs and streams the weights
faster when they are not in cache, as in decode, where every layer's weights are read once a
step: 1.3-1.7x on the default model's layer shapes, 1-32 rows, one thread (bench/linear_micro.py).
Elsewhere (fp32, whose token identity with transformers the tests pin; CUDA; a CPU without
native bf16, e.g. AVX2 only, where oneDNN has no bf16 inner product for a packed weight and
refuses to build one) it is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cpu_packs_bf16() -> bool:
    """Whether this CPU's oneDNN runs bf16 inner products on packed weights (AVX512-BF16 or
    AMX; the check Inductor's CPU freezing makes before it emits the same op)."""
    return bool(torch._C._has_mkldnn) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packs(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is prepacked: bf16 on a CPU whose oneDNN takes packed bf16."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and cpu_packs_bf16())


class Linear:
    """``x @ weight.T + bias`` for ``x [tokens, in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self._nbytes = weight.numel() * weight.element_size() + (
            0 if bias is None else bias.numel() * bias.element_size())
        self.bias = bias
        self.packed = packs(weight)
        self.weight = weight.contiguous().to_mkldnn() if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.weight, self.bias, "none", [], "")
            return out
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return self._nbytes
