"""The native GEMM over packed weights (native/gemm.c): that Linear runs it at every row count,
that it is oneDNN's to the rounding, and that a tied LM head's embeddings are looked up out of
its packing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cleave.runtime.engine.dense import linear as linear_module
from cleave.runtime.engine.dense.linear import Linear
from cleave.runtime.engine.native.kernels import PANEL, Kernels, kernels

NATIVE = kernels()
needs_native = pytest.mark.skipif(
    NATIVE is None, reason="native kernels unavailable here (see build().reason)")


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 33, 100])
@pytest.mark.parametrize("biased", [False, True])
def test_native_linear_is_onednn_to_the_rounding(rows: int, biased: bool) -> None:
    """354 outputs: six panels of 64, the last ragged (34), which up to 3 rows take 6 / rows
    panels at a time; 450: eight, of which 1 and 2 rows take the last two (one ragged) one at a
    time after such blocks; 130: three, of which 1 and 3 rows take the last ones alone. Row
    counts that split into uneven blocks of at most 6, and up to 4 rows (no software
    prefetch) against more."""
    assert NATIVE is not None
    torch.manual_seed(rows)
    for outputs in (354, 450, 130):
        weight = torch.randn(outputs, 96, dtype=torch.bfloat16)
        bias = torch.randn(outputs, dtype=torch.bfloat16) if biased else None
        wide = torch.randn(rows, 160, dtype=torch.bfloat16)
        x = wide[:, 32:128]  # rows further apart than their width
        got = NATIVE.packed_linear(x, Kernels.pack(weight), outputs, bias)
        _assert_onednn_to_the_rounding(got, x, weight, bias)


def _assert_onednn_to_the_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None) -> None:
    onednn = F.linear(x, weight, bias)
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.shape == onednn.shape and got.dtype == torch.bfloat16
    # one bf16 rounding of an fp32 sum: within half a bf16 step (2^-8 relative) plus fp32 noise
    assert torch.allclose(got.float(), exact, rtol=2 ** -8, atol=1e-3)
    assert (got == onednn).float().mean() >= 0.95


@needs_native
def test_a_rows_outputs_do_not_depend_on_its_batch() -> None:
    """Every output's fp32 sum runs over the inputs in the same order whatever the block of
    rows it is computed in, so a token's logits are the same bits alone or in any batch
    (oneDNN's, which the kernel replaced in prefill, varied with the shape)."""
    assert NATIVE is not None
    torch.manual_seed(1)
    weight = torch.randn(354, 96, dtype=torch.bfloat16)
    x = torch.randn(40, 96, dtype=torch.bfloat16)
    packed = Kernels.pack(weight)
    together = NATIVE.packed_linear(x, packed, 354)
    for start, stop in ((0, 1), (7, 8), (5, 9), (10, 12), (20, 23), (33, 40)):
        assert torch.equal(NATIVE.packed_linear(x[start:stop], packed, 354), together[start:stop])


@needs_native
@pytest.mark.parametrize("silu", [False, True])
def test_no_rows_give_no_outputs(silu: bool) -> None:
    """A step whose only prompt chunk needs no logits (a prompt longer than the step budget,
    alone) calls the LM head with no rows: that trapped (SIGFPE, the process gone) when up to
    3 rows took SP / rows panels at once."""
    assert NATIVE is not None
    weight = torch.randn(2 * 64 if silu else 354, 96, dtype=torch.bfloat16)
    packed = Kernels.pack(weight, gated=True) if silu else Kernels.pack(weight)
    outputs = 64 if silu else 354
    got = NATIVE.packed_linear(torch.empty(0, 96, dtype=torch.bfloat16), packed, outputs,
                               silu=silu)
    assert got.shape == (0, outputs)


@needs_native
def test_native_linear_rounds_to_nearest_even_and_keeps_specials() -> None:
    assert NATIVE is not None
    weight = torch.zeros(4, 32, dtype=torch.bfloat16)
    weight[:, 0] = 1.0
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    # 1 + 2^-8 is halfway between two bf16 values: it rounds to the even one, 1.0
    x[:, 0] = torch.tensor([1.0, float("inf"), float("nan"), -3.0]).to(torch.bfloat16)
    bias = torch.tensor([2 ** -8, 0, 0, 0], dtype=torch.bfloat16)
    got = NATIVE.packed_linear(x, Kernels.pack(weight), 4, bias)[:, 0]
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
    ids = torch.tensor([69, 0, 64, 5, 5])
    assert torch.equal(Kernels.rows(packed, ids, 70), weight[ids])
    assert Kernels.rows(packed, ids[:0], 70).shape == (0, 4)
    for bad in (70, 127, -1):  # past the vocabulary, into the padding, negative
        with pytest.raises(IndexError, match=r"in \[0, 70\)"):
            Kernels.rows(packed, torch.tensor([3, bad]), 70)


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 33])
def test_silu_and_mul_in_the_epilogue_rounds_as_torch_does(rows: int) -> None:
    """The fused GEMM's outputs against torch's bf16 ``F.silu(gate) * up`` over the same GEMM's
    unfused gate/up (bit-identical sums: the gated packing moves rows between panels, not
    the order of any output's fp32 sum)."""
    assert NATIVE is not None
    torch.manual_seed(rows)
    for width in (192, 224):  # 6 gated panels (in 6 / rows at a time), 7 (one more alone)
        gate_up = torch.randn(2 * width, 64, dtype=torch.bfloat16)
        x = torch.randn(rows, 64, dtype=torch.bfloat16) * 4  # some gates past e^-'s overflow
        fused = NATIVE.packed_linear(x, Kernels.pack(gate_up, gated=True), width, silu=True)
        gate, up = NATIVE.packed_linear(x, Kernels.pack(gate_up), 2 * width).chunk(2, dim=-1)
        assert fused.shape == (rows, width)
        # e^-gate overflows (from 5 rows of the first draw): silu is -0, as torch's
        assert (gate < -88.8).any() or rows < 5 or width != 192
        assert torch.equal(fused, F.silu(gate) * up)


@needs_native
def test_linear_fuses_silu_and_mul_where_the_packing_allows() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for rows, bias, fused in ((128, None, True), (96, None, False),
                              (128, torch.randn(128, dtype=torch.bfloat16), False)):
        weight = torch.randn(rows, 64, dtype=torch.bfloat16)
        layer = Linear(weight, bias, silu_and_mul=True)
        assert layer.native is not None and layer.fused is fused
        gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
        out = layer(x)
        if not fused:  # the product as is: the caller (DenseMLP) applies the activation
            assert out.shape == (3, rows)
            out = F.silu(out[:, :rows // 2]) * out[:, rows // 2:]
        assert torch.allclose(out.float(), (F.silu(gate) * up).float(), rtol=0.02, atol=0.05)
    with pytest.raises(ValueError, match="no rows to look up"):
        Linear(torch.randn(128, 64, dtype=torch.bfloat16), silu_and_mul=True).lookup(
            torch.tensor([0]))


@needs_native
def test_a_packing_of_another_shape_is_refused() -> None:
    assert NATIVE is not None
    packed = Kernels.pack(torch.randn(64, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no packing of 65 outputs"):
        NATIVE.packed_linear(torch.zeros(1, 32, dtype=torch.bfloat16), packed, 65)
    with pytest.raises(ValueError, match="against weight"):
        NATIVE.packed_linear(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(ValueError, match="gated, unbiased"):  # silu takes no bias
        NATIVE.packed_linear(torch.zeros(1, 32, dtype=torch.bfloat16), packed, 32,
                             torch.zeros(32, dtype=torch.bfloat16), silu=True)
    with pytest.raises(ValueError, match="bias"):  # one per output, bf16
        NATIVE.packed_linear(torch.zeros(1, 32, dtype=torch.bfloat16), packed, 64,
                             torch.zeros(63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no packing"):  # a packing is bf16
        NATIVE.packed_linear(torch.zeros(1, 32, dtype=torch.bfloat16), packed.float(), 64)
    with pytest.raises(ValueError, match="no whole number of 64-row panels"):
        Kernels.pack(torch.zeros(96, 32, dtype=torch.bfloat16), gated=True)


@needs_native
def test_linear_runs_packed_at_every_row_count_and_looks_up_its_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(100, 64, dtype=torch.bfloat16)
    for layer in (Linear(weight), Linear(weight, prepack=False)):
        assert layer.native is not None and not layer.packed
        assert layer.weight.shape == (2, 32, PANEL, 2)  # no row-major copy kept
        assert layer.nbytes() == 100 * 64 * 2
        ids = torch.tensor([99, 0, 42])
        assert torch.equal(layer.lookup(ids), weight[ids])
    calls: list[int] = []
    real = Kernels.packed_linear

    def spy(self: Kernels, x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        out: torch.Tensor = real(self, x, *args)  # type: ignore[arg-type]
        return out

    monkeypatch.setattr(Kernels, "packed_linear", spy)
    for rows in (1, 32, 33, 512):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.allclose(layer(x).float(), F.linear(x, weight).float(), rtol=0.02,
                              atol=0.02)
    assert calls == [1, 32, 33, 512]


def test_a_weight_in_onednns_layout_has_no_rows_to_look_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "native_for", lambda weight: None)
    monkeypatch.setattr(linear_module, "packs", lambda weight: True)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    if not linear_module.cpu_packs_bf16():
        pytest.skip("this CPU's oneDNN has no packed bf16 layout")
    assert Linear(weight).packed
    with pytest.raises(ValueError, match="no rows to look up"):
        Linear(weight).lookup(torch.tensor([1]))
    head = Linear(weight, prepack=False)  # how the decoder builds its LM head
    assert not head.packed and torch.equal(head.lookup(torch.tensor([1, 95])), weight[[1, 95]])


@pytest.mark.parametrize("weight", [
    torch.randn(8, 64),  # fp32: its token identity with transformers is pinned
    torch.randn(8, 80, dtype=torch.bfloat16),  # a width the 32-wide steps do not divide
    torch.randn(64, 8, dtype=torch.bfloat16).T,  # not row-major
])
def test_weights_the_native_kernel_does_not_take(weight: torch.Tensor) -> None:
    assert not Kernels.takes_linear(weight)
    assert linear_module.native_for(weight) is None
    layer = Linear(weight, prepack=False)
    assert layer.native is None and layer.weight is weight
    assert torch.equal(layer.lookup(torch.tensor([7, 0])), weight[[7, 0]])
