"""The dense decoder's faster kernels give the same bits as the plain formulas they replace
(what keeps bf16 greedy outputs unchanged and fp32 identical to transformers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cleave.runtime.engine.dense import linear as linear_module
from cleave.runtime.engine.dense.linear import Linear, cpu_packs_bf16
from cleave.runtime.engine.dense.norms import RMSNorm
from cleave.runtime.engine.dense.rotary import RotaryTable, apply_rotary
from cleave.runtime.engine.families.spec import RopeSpec


@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("biased", [False, True])
def test_prepacked_bf16_linear_matches_f_linear_bit_for_bit(rows: int, biased: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 80, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16) if biased else None
    linear = Linear(weight, bias)
    assert linear.packed == cpu_packs_bf16()
    assert linear.nbytes() == 96 * 80 * 2 + (96 * 2 if biased else 0)
    x = torch.randn(rows, 80, dtype=torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [1, 7])
def test_bf16_linear_on_a_cpu_without_native_bf16_runs_unpacked(
        rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU: oneDNN cannot build a packed bf16 inner product there (it raised
    "could not create a primitive descriptor" at the first forward), so the weight stays as
    it is and the output is F.linear's."""
    monkeypatch.setattr(linear_module, "cpu_packs_bf16", lambda: False)
    weight = torch.randn(96, 80, dtype=torch.bfloat16)
    linear = Linear(weight)
    assert not linear.packed and linear.weight is weight
    x = torch.randn(rows, 80, dtype=torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x, weight))


def test_fp32_linear_is_not_repacked() -> None:
    weight = torch.randn(8, 4)
    linear = Linear(weight)
    assert not linear.packed and linear.weight is weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_matches_rotate_half(dtype: torch.dtype, rotary_dim: int) -> None:
    table = RotaryTable(RopeSpec("default", 10000.0, rotary_dim, None), None, 128, dtype,
                        torch.device("cpu"))
    positions = torch.tensor([0, 5, 127, 64])
    x = torch.randn(4, 6, 64, dtype=dtype)
    # transformers' formula, from fresh fp32 tables
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    emb = torch.cat([torch.outer(positions.float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    head, tail = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
    expected = torch.cat((head * cos + rotated * sin, tail), dim=-1)
    assert torch.equal(apply_rotary(x, *table.at(positions)), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_transformers_formula(dtype: torch.dtype, offset: float) -> None:
    torch.manual_seed(0)
    weight = torch.randn(576, dtype=dtype)
    x = torch.randn(33, 576, dtype=dtype) * 4
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    expected = ((normed * (offset + weight.float())).to(dtype) if offset
                else weight * normed.to(dtype))
    norm = RMSNorm(weight, 1e-5, offset)
    norm.native = None  # the torch ops (the native kernel: test_native_kernels.py)
    assert torch.equal(norm(x), expected)
