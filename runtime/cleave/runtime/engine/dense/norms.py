"""RMSNorm in the two roundings transformers uses, so fp32 and bf16 logits match it exactly."""

from __future__ import annotations

import torch

from cleave.runtime.engine.native.kernels import Kernels, kernels


class RMSNorm:
    """``offset == 0``: Llama's ``w * x.to(dtype)``; ``offset == 1``: Gemma's
    ``(x * (1 + w)).to(dtype)`` with the scale kept in fp32."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float) -> None:
        self.eps = eps
        self.gemma = offset != 0.0
        self.weight = (offset + weight.float()) if self.gemma else weight
        # Llama's rounding in bf16 on the CPU: the native row kernel, one call for the eight
        # torch ops below (same roundings; the sum of squares in another order).
        self.native = (kernels() if not self.gemma and weight.dtype == torch.bfloat16
                       and weight.device.type == "cpu" else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and Kernels.takes_rows(x, x.shape[-1]):
            return self.native.rms_norm(x, self.weight, self.eps)
        # fp32 statistics, as transformers computes them. torch.rms_norm gives the same bits as
        # its x * rsqrt(mean(x^2) + eps); on the CPU it is a composite of those ops, so this
        # saves Python-level calls, not kernels.
        xf = torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.gemma:
            return (xf * self.weight).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
