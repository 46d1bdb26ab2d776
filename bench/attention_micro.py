"""Microbench of the native attention kernels on the default model's layer shape (9 query heads,
3 kv heads, head_dim 64, bf16, one thread), each against its baseline in the same run:

- prefill (engine/native/prefill.c) against dense/attention.py's tiled bmm path (the pool
  gathered first, as that path does), fresh chunks and chunks over earlier context, with each
  one's max error against an fp32 reference;
- decode (engine/native/attention.c), 32 sequences over 500 keys, 30 layers' pools so the KV
  comes from memory: over scattered block tables, over contiguous ones, and from cache (every
  sequence on the same blocks): what the pool's layout costs.

The last line is JSON with every figure.

    python bench/attention_micro.py     # ~1 min on 2 CPU cores
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable

import torch
from linear_micro import median_seconds

from cleave.runtime.engine.dense.attention import gather, tiled_causal_attention
from cleave.runtime.engine.native.kernels import Kernels, kernels

NQ, NKV, D, BS = 9, 3, 64, 16
SCALE = 0.125


def median_ms(fn: Callable[[], object]) -> float:
    return median_seconds(fn) * 1e3


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int) -> torch.Tensor:
    """fp32 causal attention of ``q [L, nq, d]`` at positions context.. over ``[nkv, S, d]``."""
    length, total = q.shape[0], k.shape[1]
    qg = q.float().view(length, NKV, NQ // NKV, D).permute(1, 2, 0, 3)
    scores = qg @ k.float().unsqueeze(1).transpose(-1, -2) * SCALE
    visible = torch.arange(total)[None, :] <= context + torch.arange(length)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ v.float().unsqueeze(1)).permute(2, 0, 1, 3).reshape(length, NQ, D)


def prefill(native: Kernels) -> dict[str, dict[str, float]]:
    blocks = 200
    k_pool = torch.randn(NKV, blocks, BS, D, dtype=torch.bfloat16)
    v_pool = torch.randn(NKV, blocks, BS, D, dtype=torch.bfloat16)
    out: dict[str, dict[str, float]] = {}
    for context, length in [(0, 64), (0, 256), (0, 512), (256, 256), (512, 512), (1024, 512)]:
        total = context + length
        table = torch.randperm(blocks)[: -(-total // BS)]
        q = torch.randn(length, NQ, D, dtype=torch.bfloat16)

        flash = functools.partial(native.prefill_attention, q, k_pool, v_pool, table, context,
                                  SCALE)
        tiled = functools.partial(tiled_path, q, k_pool, v_pool, table, context)
        flash_ms, tiled_ms = median_ms(flash), median_ms(tiled)
        ref = exact(q, _keys(k_pool, table, total), _keys(v_pool, table, total), context)
        flops = 4 * D * NQ * length * (context + (length + 1) / 2)
        name = f"{length} over {context}"
        out[name] = {"native_ms": round(flash_ms, 2), "tiled_ms": round(tiled_ms, 2),
                     "native_gflops": round(flops / flash_ms / 1e6, 1),
                     "native_max_err": float((flash().float() - ref).abs().max()),
                     "tiled_max_err": float((tiled().transpose(0, 1).float() - ref).abs().max())}
        print(f"prefill {name:12s}: native {flash_ms:6.2f} ms, tiled {tiled_ms:6.2f} ms",
              file=sys.stderr)
    return out


def tiled_path(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               table: torch.Tensor, context: int) -> torch.Tensor:
    """dense/attention.py's path where the native kernel does not run: gather, then tiles."""
    total = context + q.shape[0]
    k = gather(k_pool, table.unsqueeze(0))[:, 0, :total]
    v = gather(v_pool, table.unsqueeze(0))[:, 0, :total]
    return tiled_causal_attention(q.transpose(0, 1), k, v, context, SCALE)


def _keys(pool: torch.Tensor, table: torch.Tensor, count: int) -> torch.Tensor:
    return pool[:, table].reshape(NKV, -1, D)[:, :count]


def decode(native: Kernels, seqs: int = 32, context: int = 500) -> dict[str, float]:
    per_seq = -(-context // BS)
    pools = [(torch.randn(NKV, seqs * per_seq, BS, D, dtype=torch.bfloat16),
              torch.randn(NKV, seqs * per_seq, BS, D, dtype=torch.bfloat16)) for _ in range(30)]
    lengths = torch.full((seqs,), context, dtype=torch.int64)
    q = torch.randn(seqs, NQ, D, dtype=torch.bfloat16)
    tables = {"scattered": torch.randperm(seqs * per_seq).view(seqs, per_seq),
              "contiguous": torch.arange(seqs * per_seq).view(seqs, per_seq),
              "cached": torch.arange(per_seq).repeat(seqs, 1)}
    out = {}
    for name, table in tables.items():
        layers = pools[:1] * 30 if name == "cached" else pools
        out[f"{name}_ms"] = round(median_ms(functools.partial(
            decode_layers, native, q, layers, table, lengths)), 1)
        print(f"decode {seqs} x {context}, 30 layers, {name}: {out[f'{name}_ms']} ms",
              file=sys.stderr)
    return out


def decode_layers(native: Kernels, q: torch.Tensor,
                  layers: list[tuple[torch.Tensor, torch.Tensor]], table: torch.Tensor,
                  lengths: torch.Tensor) -> None:
    for k, v in layers:
        native.decode_attention(q, k, v, table, lengths, SCALE)


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    native = kernels()
    if native is None:
        print(json.dumps({"native_kernels": False}))
        return 0
    print(json.dumps({"native_kernels": True, "prefill_per_layer": prefill(native),
                      "decode_32x500_30_layers": decode(native)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
