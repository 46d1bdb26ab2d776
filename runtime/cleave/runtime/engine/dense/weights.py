"""A checkpoint's tensors gathered into one layer's weights, fused where that saves kernel
launches (q/k/v in one matmul, gate/up in one), under the names the family's spec gives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cleave.runtime.engine.dense.linear import Linear
from cleave.runtime.engine.dense.mlp import MLP, load_mlp
from cleave.runtime.engine.dense.moe import Activation
from cleave.runtime.engine.dense.norms import RMSNorm
from cleave.runtime.engine.families.spec import DecoderSpec
from cleave.runtime.engine.parallel.shard import Shard

Fetch = Callable[[str], torch.Tensor]


@dataclass
class LayerWeights:
    attn_in_norm: RMSNorm
    attn_out_norm: RMSNorm | None
    mlp_in_norm: RMSNorm
    mlp_out_norm: RMSNorm | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    qkv: Linear
    o_proj: Linear
    mlp: MLP  # dense, or the experts the spec selects for this layer

    def nbytes(self) -> int:
        norms = [n for n in (self.attn_in_norm, self.attn_out_norm, self.mlp_in_norm,
                             self.mlp_out_norm, self.q_norm, self.k_norm) if n is not None]
        return self.mlp.nbytes() + self.qkv.nbytes() + self.o_proj.nbytes() + sum(
            n.nbytes() for n in norms)


def load_layer(spec: DecoderSpec, index: int, fetch: Fetch, act: Activation,
               shard: Shard | None = None) -> LayerWeights:
    """One layer's weights; with ``shard``, only this tensor-parallel rank's slice of them."""
    names, prefix = spec.names, f"model.layers.{index}."

    def cat(parts: tuple[str, ...]) -> torch.Tensor:
        tensors = [fetch(prefix + p) for p in parts]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors).contiguous()

    def norm(name: str | None) -> RMSNorm | None:
        if name is None:
            return None
        return RMSNorm(fetch(prefix + name), spec.rms_norm_eps, spec.norm_offset)

    attn_in, mlp_in = norm(names.attn_in_norm), norm(names.mlp_in_norm)
    assert attn_in is not None and mlp_in is not None
    qkv = cat(names.qkv)
    qkv_bias = cat(names.qkv_bias) if names.qkv_bias else None
    o_proj = fetch(prefix + names.o_proj)
    o_bias = fetch(prefix + names.o_bias) if names.o_bias else None
    if shard is not None:
        qkv = shard.qkv(qkv, spec.shape)
        qkv_bias = None if qkv_bias is None else shard.qkv(qkv_bias, spec.shape)
        o_proj = shard.columns(o_proj, "the attention heads")
        o_bias = shard.keep_bias(o_bias)
    return LayerWeights(
        attn_in_norm=attn_in, attn_out_norm=norm(names.attn_out_norm),
        mlp_in_norm=mlp_in, mlp_out_norm=norm(names.mlp_out_norm),
        q_norm=norm(names.q_norm), k_norm=norm(names.k_norm),
        qkv=Linear(qkv, qkv_bias), o_proj=Linear(o_proj, o_bias),
        mlp=load_mlp(spec, index, fetch, act, shard))
