"""Transformers' attention calls, answered from the paged KV pool.

Registered with transformers' ``AttentionInterface`` as ``cleave_paged``: each attention module
of a model loaded with that implementation calls :func:`paged_attention_hook` with the step's
``query/key/value [1, heads, T, d]``. The hook writes the step's K/V into the pool by the batch's
slot mapping and attends over the pool with the dense path's paged attention (decode groups and
prefill chunks alike). Which step, and which layer, comes from the :class:`StepContext` the model
sets around its forward: layers are counted in call order.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch

from cleave.runtime.engine.dense.attention import AttentionConfig, paged_attention
from cleave.runtime.engine.paged_model import AttentionBatch

NAME = "cleave_paged"
# Keyword arguments that carry attention features the pool cannot honour, and what they are.
_REFUSED_KWARGS = {"s_aux": "attention sinks", "sinks": "attention sinks",
                   "position_bias": "additive position biases (ALiBi, T5-style)"}


@dataclass(frozen=True)
class CallRecord:
    """What one attention call looked like, as a probe forward records it."""

    num_kv_heads: int
    head_dim: int
    window: int | None
    cross: bool  # keys of another length than the queries: cross-attention or a KV cache
    refused: str | None  # an attention feature the generic path cannot honour


@dataclass
class StepContext:
    batch: AttentionBatch | None  # None: a probe forward, recording calls instead
    k_pool: list[torch.Tensor]
    v_pool: list[torch.Tensor]
    tiled_prefill: bool
    calls: list[CallRecord] = field(default_factory=list)


STEP: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("cleave_step",
                                                                            default=None)


def paged_attention_hook(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature; returns ``[1, T, heads, d]`` and no weights."""
    step = STEP.get()
    if step is None:
        raise RuntimeError(f"'{NAME}' attention runs only inside the engine's forward")
    layer = len(step.calls)
    window = kwargs.get("sliding_window")
    step.calls.append(_record(module, query, key, window, kwargs))
    if step.batch is None:  # probe: the shapes are all it wants
        return torch.zeros_like(query).transpose(1, 2), None
    nkv, d = key.shape[1], key.shape[-1]
    k_cache, v_cache = step.k_pool[layer], step.v_pool[layer]
    k_cache.view(nkv, -1, d).index_copy_(1, step.batch.slot_mapping, key[0])
    v_cache.view(nkv, -1, d).index_copy_(1, step.batch.slot_mapping, value[0])
    cfg = AttentionConfig(scale=scaling if scaling is not None else d ** -0.5,
                          softcap=kwargs.get("softcap"), window=window,
                          tiled_prefill=step.tiled_prefill)
    out = paged_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), k_cache, v_cache, step.batch, cfg)
    return out.unsqueeze(0), None


def _record(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
            window: int | None, kwargs: dict[str, Any]) -> CallRecord:
    refused = next((what for name, what in _REFUSED_KWARGS.items()
                    if kwargs.get(name) is not None), None)
    if refused is None and (kwargs.get("is_causal") is False
                            or getattr(module, "is_causal", True) is False):
        refused = "bidirectional (non-causal) attention"
    return CallRecord(num_kv_heads=key.shape[1], head_dim=key.shape[-1], window=window,
                      cross=key.shape[2] != query.shape[2], refused=refused)


def register() -> None:
    """Make ``attn_implementation='cleave_paged'`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_attention_hook)
