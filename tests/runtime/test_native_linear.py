"""The native linear kernels: the packed GEMM (native/gemm.c) that runs a layer's own weights
at every row count, and the row-major GEMV (native/linear.c) that runs a tied LM head; which
one Linear picks, and that both are oneDNN's to the rounding."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from cleave.runtime.engine.dense import linear as linear_module
from cleave.runtime.engine.dense.linear import NATIVE_MAX_ROWS, Linear
from cleave.runtime.engine.native.kernels import PANEL, Kernels, kernels

NATIVE = kernels()
needs_native = pytest.mark.skipif(
    NATIVE is None, reason="native kernels unavailable here (see build().reason)")

Run = Callable[[Kernels, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
KERNELS: dict[str, Run] = {
    "packed": lambda k, x, w, b: k.packed_linear(x, Kernels.pack(w), w.shape[0], b),
    "row-major": lambda k, x, w, b: k.linear(x, w, b),
}


@needs_native
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 33, 100])
@pytest.mark.parametrize("biased", [False, True])
def test_native_linear_is_onednn_to_the_rounding(kernel: str, rows: int, biased: bool) -> None:
    """130 outputs: a ragged last panel of 64 and a ragged last tile of 4; row counts that
    split into uneven blocks of at most 6."""
    assert NATIVE is not None
    torch.manual_seed(rows)
    weight = torch.randn(130, 96, dtype=torch.bfloat16)
    bias = torch.randn(130, dtype=torch.bfloat16) if biased else None
    wide = torch.randn(rows, 160, dtype=torch.bfloat16)
    x = wide[:, 32:128]  # rows further apart than their width
    got = KERNELS[kernel](NATIVE, x, weight, bias)
    onednn = F.linear(x, weight, bias)
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.shape == (rows, 130) and got.dtype == torch.bfloat16
    # one bf16 rounding of an fp32 sum: within half a bf16 step (2^-8 relative) plus fp32 noise
    assert torch.allclose(got.float(), exact, rtol=2 ** -8, atol=1e-3)
    assert (got == onednn).float().mean() >= 0.95


@needs_native
@pytest.mark.parametrize("kernel", KERNELS)
def test_native_linear_rounds_to_nearest_even_and_keeps_specials(kernel: str) -> None:
    assert NATIVE is not None
    weight = torch.zeros(4, 32, dtype=torch.bfloat16)
    weight[:, 0] = 1.0
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    # 1 + 2^-8 is halfway between two bf16 values: it rounds to the even one, 1.0
    x[:, 0] = torch.tensor([1.0, float("inf"), float("nan"), -3.0]).to(torch.bfloat16)
    bias = torch.tensor([2 ** -8, 0, 0, 0], dtype=torch.bfloat16)
    got = KERNELS[kernel](NATIVE, x, weight, bias)[:, 0]
    assert got[0].item() == 1.0
    assert got[1].item() == float("inf") and got[2].isnan() and got[3].item() == -3.0


def test_packing_puts_each_outputs_input_pairs_side_by_side() -> None:
    weight = torch.arange(70 * 4, dtype=torch.float32).view(70, 4).to(torch.bfloat16)
    packed = Kernels.pack(weight)
    assert packed.shape == (2, 2, PANEL, 2)  # 70 outputs: two panels, the last padded
    for n in (0, 5, 63, 64, 69):
        for k in range(4):
            assert packed[n // PANEL, k // 2, n % PANEL, k % 2] == weight[n, k]
    assert not packed[1, :, 6:].any()  # the padding rows are zeros


@needs_native
def test_a_packing_of_another_shape_is_refused() -> None:
    assert NATIVE is not None
    packed = Kernels.pack(torch.randn(64, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no packing of 65 outputs"):
        NATIVE.packed_linear(torch.zeros(1, 32, dtype=torch.bfloat16), packed, 65)
    with pytest.raises(ValueError, match="against weight"):
        NATIVE.packed_linear(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 64)


def _spy(monkeypatch: pytest.MonkeyPatch, name: str, calls: list[tuple[str, int]]) -> None:
    real = getattr(Kernels, name)

    def spy(self: Kernels, x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append((name, x.shape[0]))
        out: torch.Tensor = real(self, x, *args)
        return out

    monkeypatch.setattr(Kernels, name, spy)


@needs_native
def test_own_weights_run_packed_at_every_row_count_and_a_tied_head_row_major(
        monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(64, 64, dtype=torch.bfloat16)
    own, head = Linear(weight), Linear(weight, prepack=False)
    assert own.native_packed and not own.packed and own.weight.shape == (1, 32, PANEL, 2)
    assert not head.native_packed and head.weight is weight  # the embeddings stay row-major
    assert own.nbytes() == head.nbytes() == 64 * 64 * 2
    calls: list[tuple[str, int]] = []
    _spy(monkeypatch, "packed_linear", calls)
    _spy(monkeypatch, "linear", calls)
    for rows in (1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 512):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        for layer in (own, head):
            assert torch.allclose(layer(x).float(), F.linear(x, weight).float(), rtol=0.02,
                                  atol=0.02)
    assert calls == [("packed_linear", 1), ("linear", 1),
                     ("packed_linear", NATIVE_MAX_ROWS), ("linear", NATIVE_MAX_ROWS),
                     ("packed_linear", NATIVE_MAX_ROWS + 1), ("packed_linear", 512)]


@pytest.mark.parametrize("weight", [
    torch.randn(8, 64),  # fp32: its token identity with transformers is pinned
    torch.randn(8, 80, dtype=torch.bfloat16),  # a width the 32-wide steps do not divide
    torch.randn(64, 8, dtype=torch.bfloat16).T,  # not row-major
])
def test_weights_the_native_kernel_does_not_take(weight: torch.Tensor) -> None:
    assert not Kernels.takes_linear(weight)
    assert linear_module.native_for(weight) is None
    assert not Linear(weight).native_packed
