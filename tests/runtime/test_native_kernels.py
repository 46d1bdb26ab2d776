"""The native CPU kernels (runtime/cleave/runtime/engine/native): when they are used, how they
are built and cached, and that their outputs are oneDNN's to the rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cleave.runtime.engine.dense import linear as linear_module
from cleave.runtime.engine.native import build as build_module
from cleave.runtime.engine.native import kernels as kernels_module
from cleave.runtime.engine.native.args import LayerArgs, check_indices
from cleave.runtime.engine.native.build import CPU_FLAGS, Built, build, cpu_flags, unavailable
from cleave.runtime.engine.native.kernels import Kernels, kernels

NATIVE = kernels()
needs_native = pytest.mark.skipif(
    NATIVE is None, reason="native kernels unavailable here (see build().reason)")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t\t: x\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "absent") == frozenset()


def test_unavailable_says_why() -> None:
    assert unavailable(CPU_FLAGS, "/usr/bin/cc", None) is None
    assert unavailable(CPU_FLAGS, "/usr/bin/cc", "1") is None
    assert unavailable(CPU_FLAGS, "/usr/bin/cc", "off") == "CLEAVE_NATIVE_KERNELS=off"
    assert unavailable(frozenset({"avx2", "avx512f"}), "/usr/bin/cc", None) == (
        "the CPU lacks avx512_bf16, avx512bw, avx512vl")
    assert "no C compiler" in str(unavailable(CPU_FLAGS, None, None))


def test_switched_off_builds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEAVE_NATIVE_KERNELS", "0")
    built = build(tmp_path)
    assert built.path is None and built.reason == "CLEAVE_NATIVE_KERNELS=0"
    assert list(tmp_path.iterdir()) == []


def test_a_failing_compiler_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_module, "cpu_flags", lambda: CPU_FLAGS)
    monkeypatch.setenv("CC", "false")
    built = build(tmp_path)
    assert built.path is None and "failed" in built.reason
    assert not list(tmp_path.glob("*.so"))


@needs_native
def test_built_once_then_cached(tmp_path: Path) -> None:
    first = build(tmp_path)
    second = build(tmp_path)
    assert first.reason == "built" and second.reason == "cached"
    assert first.path == second.path and first.path is not None and first.path.exists()
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary left


def _pool(nkv: int, blocks: int, bs: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(nkv, blocks, bs, d, dtype=torch.bfloat16),
            torch.randn(nkv, blocks, bs, d, dtype=torch.bfloat16))


def _exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """fp32 reference: ``q [rows, nq, d]`` over ``k``/``v [nkv, keys, d]``, ``visible [rows,
    keys]``."""
    rows, nq, d = q.shape
    nkv = k.shape[0]
    qg = q.float().view(rows, nkv, nq // nkv, d).permute(1, 2, 0, 3)  # [nkv, g, rows, d]
    scores = qg @ k.float().unsqueeze(1).transpose(-1, -2) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ v.float().unsqueeze(1)).permute(2, 0, 1, 3).reshape(rows, nq, d)


def _assert_two_roundings(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, visible: torch.Tensor, scale: float) -> None:
    """Both attention kernels' error bound against fp32: fp32 scores and sums, and two bf16
    roundings (relative error at most 2^-8 each): the probabilities for the values' product
    (at most 2^-8 * sum_i p_i |v_i|) and the output; 1 % of slack for the fp32 sums and the
    polynomial exp (~1e-6 relative)."""
    exact = _exact_attention(q, k, v, visible, scale)
    spread = _exact_attention(q, k, v.abs(), visible, scale)  # sum_i p_i |v_i|
    bound = 2 ** -8 * (exact.abs() + spread) * 1.01 + 1e-5
    assert ((got.float() - exact).abs() <= bound).all()


def _keys(pool: torch.Tensor, table: torch.Tensor, count: int) -> torch.Tensor:
    nkv, _, _, d = pool.shape
    return pool[:, table].reshape(nkv, -1, d)[:, :count]


@needs_native
@pytest.mark.parametrize(("d", "nq"), [(64, 6), (128, 6), (96, 6), (256, 4), (64, 12)])
def test_decode_attention_reads_the_pool_through_block_tables(d: int, nq: int) -> None:
    """Head widths with 4, 2 and 1 heads per pass over the values, and 6 query heads a kv
    head (two passes)."""
    assert NATIVE is not None
    torch.manual_seed(d)
    nkv, bs, blocks = 2, 16, 40
    k_pool, v_pool = _pool(nkv, blocks, bs, d)
    lengths = torch.tensor([1, 17, 40, 64])  # one key; a block and one; ragged; whole blocks
    tables = torch.stack([torch.randperm(blocks)[:4] for _ in lengths])  # scattered blocks
    q = torch.randn(len(lengths), nq, d, dtype=torch.bfloat16)
    got = NATIVE.decode_attention(q, k_pool, v_pool, tables, lengths, d ** -0.5)
    none = NATIVE.decode_attention(q[:1], k_pool, v_pool, tables[:1], torch.tensor([0]), 0.1)
    assert not none.any()  # no keys: zeros, not 0 x inf
    for s, length in enumerate(lengths.tolist()):
        k, v = _keys(k_pool, tables[s], length), _keys(v_pool, tables[s], length)
        _assert_two_roundings(got[s:s + 1], q[s:s + 1], k, v,
                              torch.ones(1, length, dtype=torch.bool), d ** -0.5)


@needs_native
@pytest.mark.parametrize(("context", "length", "d", "nq"), [
    (0, 1, 64, 9), (0, 5, 64, 9), (0, 37, 64, 9), (0, 37, 128, 9), (0, 19, 96, 9),
    (45, 37, 64, 9),  # over earlier context, key blocks straddling the chunk's start
    (31, 1, 256, 3),  # one query row: a block of QR rows that is mostly padding
    (100, 70, 128, 18),  # 6 query heads a kv head, rows of one block spanning tokens
    (64, 64, 64, 3),  # one query head a kv head, everything whole blocks
])
def test_prefill_attention_is_causal_over_context_and_chunk(context: int, length: int, d: int,
                                                            nq: int) -> None:
    """prefill.c against an fp32 reference: blocks of 32 keys and 12 query rows, so these
    lengths cover partial and whole blocks, masked and unmasked, over scattered pool blocks."""
    assert NATIVE is not None
    torch.manual_seed(length + context)
    nkv, bs, blocks = 3, 16, 24
    k_pool, v_pool = _pool(nkv, blocks, bs, d)
    total = context + length
    table = torch.randperm(blocks)[: -(-total // bs)]
    q = torch.randn(length, nq, d, dtype=torch.bfloat16)
    got = NATIVE.prefill_attention(q, k_pool, v_pool, table, context, 0.125)
    visible = torch.arange(total)[None, :] <= context + torch.arange(length)[:, None]
    k, v = _keys(k_pool, table, total), _keys(v_pool, table, total)
    assert got.shape == (length, nq, d)
    _assert_two_roundings(got, q, k, v, visible, 0.125)
    with pytest.raises(ValueError, match="cannot hold"):
        NATIVE.prefill_attention(q, k_pool, v_pool, table[:0], context, 0.125)
    assert NATIVE.prefill_attention(q[:0], k_pool, v_pool, table, context, 0.125).shape == (
        0, nq, d)


@needs_native
def test_prefill_attention_refuses_shapes_it_cannot_run() -> None:
    """Head widths past its per-row buffers, and query heads that are no multiple of the kv
    heads, raise instead of reading or leaving memory they should not."""
    assert NATIVE is not None
    table = torch.arange(2)
    for nq, nkv, d in [(4, 2, 288), (5, 2, 64), (4, 2, 48)]:
        k_pool, v_pool = _pool(nkv, 2, 16, d)
        q = torch.randn(3, nq, d, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="prefill_attention"):
            NATIVE.prefill_attention(q, k_pool, v_pool, table, 0, 0.125)


@needs_native
def test_row_kernels_round_as_the_torch_ops_they_replace() -> None:
    """RMSNorm and rotary: the same bf16 roundings as the torch ops (norms.py, rotary.py), so
    outputs agree but for the fp32 sum order of the norm (SiLU-and-mul, fused into the GEMM:
    test_native_linear.py)."""
    assert NATIVE is not None
    torch.manual_seed(0)
    x = torch.randn(7, 96, dtype=torch.bfloat16) * 3
    weight = torch.randn(96, dtype=torch.bfloat16)
    torch_norm = weight * torch.rms_norm(x.float(), (96,), eps=1e-5).to(torch.bfloat16)
    norm = NATIVE.rms_norm(x, weight, 1e-5)
    assert (norm == torch_norm).float().mean() >= 0.98
    assert torch.allclose(norm.float(), torch_norm.float(), rtol=2 ** -7, atol=1e-2)

    for heads, d in ((3, 64), (2, 96), (1, 256)):  # a half of 48; the widest buffer
        qkv = torch.randn(4, (heads + 1) * d, dtype=torch.bfloat16)  # a trailing head stays
        cos = torch.randn(4, d, dtype=torch.bfloat16)
        sin = torch.randn(4, d, dtype=torch.bfloat16)
        x3 = qkv[:, :heads * d].view(4, heads, d)
        want = x3 * cos[:, None] + torch.roll(x3, d // 2, -1) * sin[:, None]
        tail = qkv[:, heads * d:].clone()
        NATIVE.rotary_(qkv, heads, d, cos, sin)
        assert torch.equal(qkv[:, :heads * d].view(4, heads, d), want)
        assert torch.equal(qkv[:, heads * d:], tail)
    # a head whose half is not whole vectors (16, 48), or wider than the kernel's buffer
    for width in (16, 48, 288):
        assert not Kernels.takes_head_dim(width)
        with pytest.raises(ValueError, match="head_dim"):
            NATIVE.rotary_(torch.zeros(2, width, dtype=torch.bfloat16), 1, width,
                           torch.zeros(2, width, dtype=torch.bfloat16),
                           torch.zeros(2, width, dtype=torch.bfloat16))


@needs_native
def test_argmax_picks_as_torch_does() -> None:
    """The sampler's greedy pick (argmax_f32): torch.argmax's index on every row, the first
    of tied largest values, the first NaN, an all -inf row, widths that are not whole 16-lane
    vectors."""
    assert NATIVE is not None
    torch.manual_seed(0)
    for width in (1, 15, 16, 17, 49152):
        x = torch.randn(9, width)
        x[1] = 2.0  # every value tied: the first
        x[2] = float("-inf")
        x[3, width // 2] = float("nan")
        x[4, width - 1] = float("nan")
        x[5, :] = x[5].clamp(max=1.0)
        x[5, width - 1] = x[5, 0] = 3.0  # a tie across lanes and vectors
        x[6, width - 1] = 1e30  # the largest in the last, partly filled, vector
        x[7, : width // 2] = float("-inf")
        want = x.argmax(dim=-1).tolist()
        assert Kernels.takes_argmax(x)
        assert NATIVE.argmax(x) == want, width
    for refused in (torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(4, 2).t(),
                    torch.zeros(4), torch.zeros(2, 0)):
        assert not Kernels.takes_argmax(refused)


def test_kernels_step_aside_for_more_torch_threads() -> None:
    """They run one thread; with more, torch's multi-threaded kernels are chosen."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernels() is None
        assert linear_module.native_for(torch.zeros(8, 64, dtype=torch.bfloat16)) is None
    finally:
        torch.set_num_threads(threads)


def test_an_unwritable_cache_is_a_reason_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_module, "cpu_flags", lambda: CPU_FLAGS)
    monkeypatch.setattr(build_module, "_compiler", lambda: "/usr/bin/true")
    monkeypatch.setattr(build_module, "cache_dir", lambda: tmp_path / "file")
    (tmp_path / "file").write_text("not a directory")
    built = build()
    assert built.path is None and "could not build" in built.reason


def test_an_unloadable_library_is_a_reason_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    junk = tmp_path / "kernels-junk.so"
    junk.write_text("not a shared object")
    monkeypatch.setattr(kernels_module, "build", lambda: Built(junk, "cached"))
    assert kernels_module._library.__wrapped__() is None


def test_attention_indices_are_checked_before_the_kernels_trust_them() -> None:
    tables = torch.zeros(2, 3, dtype=torch.int64)
    check_indices(tables, torch.tensor([48, 1]), 16)  # three whole blocks fit
    with pytest.raises(ValueError, match="past its block table"):
        check_indices(tables, torch.tensor([49, 1]), 16)
    with pytest.raises(ValueError, match="int64"):
        check_indices(tables.int(), torch.tensor([1, 1]), 16)
    with pytest.raises(ValueError, match="int64"):  # the slots of a step
        check_indices(tables, torch.tensor([1, 1]), 16, torch.zeros(2, dtype=torch.int32))
    # the kernel's caller refuses too, before any C runs
    if NATIVE is not None:
        pool = torch.zeros(1, 4, 16, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="past its block table"):
            NATIVE.decode_attention(torch.zeros(2, 1, 64, dtype=torch.bfloat16), pool, pool,
                                    tables, torch.tensor([49, 1]), 0.125)


def test_the_layer_scratch_covers_what_layer_c_carves_from_it() -> None:
    """layer.c's bbuf: normed input, qkv, attention output, activation (gate/up never written
    out: the GEMM's epilogue applies SiLU-and-mul)."""
    args = LayerArgs(576, 9, 3, 64, 1536)
    assert args.scratch_words(2) == 2 * (576 + (9 + 6) * 64 + 9 * 64 + 1536)
