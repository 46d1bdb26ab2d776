"""A step's layers run by the native kernels, one call per layer (native/layer.c
``step_layer_bf16``: decodes and prefill chunks alike), for Llama-shaped layers: pre-norms
only, full rotary, plain causal attention, a dense SiLU MLP, one rank, bf16 on an AVX512-BF16
CPU, every linear packed for native/gemm.c (gate_up with SiLU-and-mul fused). Other layers
take the torch path, whose roundings the kernel keeps op for op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cleave.runtime.engine.dense.attention import AttentionConfig
from cleave.runtime.engine.dense.mlp import DenseMLP
from cleave.runtime.engine.dense.weights import LayerWeights
from cleave.runtime.engine.native.args import LayerArgs, StepIndex, stack_tables
from cleave.runtime.engine.native.kernels import Kernels
from cleave.runtime.engine.paged_model import AttentionBatch


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def layer_args(layer: LayerWeights, cfg: AttentionConfig, nq: int, nkv: int, d: int,
               eps: float) -> LayerArgs | None:
    """The kernel's view of ``layer``, or None where the layer is not the shape it runs."""
    mlp = layer.mlp
    if (cfg.native is None or not cfg.plain or layer.q_norm is not None
            or layer.attn_out_norm is not None or layer.mlp_out_norm is not None
            or not isinstance(mlp, DenseMLP) or mlp.act is not F.silu
            or layer.attn_in_norm.gemma or layer.mlp_in_norm.gemma
            or any(lin.native is None for lin in (layer.qkv, layer.o_proj, mlp.down))
            or not mlp.gate_up.fused
            or layer.qkv.in_features % 16):  # norms and residual adds: whole 16-lane vectors
        return None
    hidden, inter = layer.qkv.in_features, mlp.down.in_features
    shapes = [(layer.qkv.out_features, (nq + 2 * nkv) * d), (layer.o_proj.in_features, nq * d),
              (layer.o_proj.out_features, hidden), (mlp.gate_up.in_features, hidden),
              (mlp.gate_up.out_features, 2 * inter), (mlp.down.out_features, hidden),
              (layer.attn_in_norm.weight.numel(), hidden),
              (layer.mlp_in_norm.weight.numel(), hidden)]
    if any(got != want for got, want in shapes):  # the kernel sizes its buffers from these
        return None
    return LayerArgs(
        hidden, nq, nkv, d, inter, eps, cfg.scale,
        _ptr(layer.attn_in_norm.weight), _ptr(layer.qkv.weight), _ptr(layer.qkv.bias),
        _ptr(layer.o_proj.weight), _ptr(layer.o_proj.bias), _ptr(layer.mlp_in_norm.weight),
        _ptr(mlp.gate_up.weight), _ptr(mlp.down.weight))


class NativeLayers:
    """Every layer of a model in the kernel's terms; built only when every layer qualifies,
    all with one shape (so one scratch layout serves them all)."""

    def __init__(self, kernels: Kernels, layers: list[LayerArgs],
                 keep: list[LayerWeights]) -> None:
        self.kernels, self.layers = kernels, layers
        self._keep = keep  # the tensors the pointers above point into

    @staticmethod
    def takes(batch: AttentionBatch, tokens: int) -> bool:
        """Every step with tokens whose prefill chunks read the pool through a table."""
        return tokens > 0 and all(table is not None for *_, table, _ in batch.prefills)

    def run(self, h: torch.Tensor, batch: AttentionBatch, cos: torch.Tensor,
            sin: torch.Tensor, k_pool: list[torch.Tensor],
            v_pool: list[torch.Tensor]) -> torch.Tensor:
        """All layers over ``h [tokens, hidden]`` (a fresh tensor, updated in place)."""
        rows, bs = h.shape[0], k_pool[0].shape[2]
        index = step_index(batch, bs)
        scratch = self.kernels.step_scratch(self.layers[0], index, rows, k_pool[0])
        h = h.contiguous()
        cos = cos.reshape(rows, -1).contiguous()
        sin = sin.reshape(rows, -1).contiguous()
        for args, k, v in zip(self.layers, k_pool, v_pool, strict=True):
            self.kernels.step_layer(args, h, cos, sin, k, v, index, scratch)
        return h


def step_index(batch: AttentionBatch, block_size: int) -> StepIndex:
    """``batch`` in the step kernel's terms: its decode groups' tables stacked (their rows
    come first), then its prefill chunks' spans and tables (every chunk's table present:
    :meth:`NativeLayers.takes`)."""
    groups, chunks = batch.decode_groups, batch.prefills
    tables = stack_tables([g.block_tables for g in groups],
                          [int(g.lengths.max()) if g.count else 0 for g in groups], block_size)
    lengths = (torch.cat([g.lengths for g in groups]) if groups
               else torch.zeros(0, dtype=torch.int64))
    chunk_tables = stack_tables([table for *_, table, _ in chunks if table is not None],
                                [context + length for _, length, context, *_ in chunks],
                                block_size)
    spans = torch.tensor([(first, length, context) for first, length, context, *_ in chunks],
                         dtype=torch.int64).reshape(-1, 3)
    return StepIndex(batch.slot_mapping.contiguous(), tables, lengths.contiguous(), spans,
                     chunk_tables)


def build(kernels: Kernels | None, layers: list[LayerWeights], configs: list[AttentionConfig],
          nq: int, nkv: int, d: int, eps: float, eligible: bool) -> NativeLayers | None:
    """``eligible``: the model-wide conditions (one full-width rotary table, one rank)."""
    if kernels is None or not eligible:
        return None
    args = [layer_args(layer, cfg, nq, nkv, d, eps) for layer, cfg in zip(layers, configs,
                                                                         strict=True)]
    kept = [a for a in args if a is not None]
    if len(kept) < len(args) or len({(a.hidden, a.inter) for a in kept}) != 1:
        return None  # one buffer layout serves every layer
    return NativeLayers(kernels, kept, layers)
