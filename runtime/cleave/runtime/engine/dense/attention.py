"""Attention over the paged KV pool, with an optional sliding window, logit soft-cap and scale.

A sequence's KV is read through its block table. Decodes of the whole batch share one
gathered, masked pair of matmuls; a prefill chunk with no earlier context attends over its own
fresh K/V without touching the pool. Plain causal layers keep the fast paths (the native
kernels, which read the pool in place, where they run; else tiled bf16 on CPU, fused SDPA
elsewhere); windowed or soft-capped layers take an explicit masked path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cleave.runtime.engine.native.kernels import Kernels
from cleave.runtime.engine.paged_model import AttentionBatch, DecodeGroup


@dataclass(frozen=True)
class AttentionConfig:
    scale: float  # multiplies q.k
    softcap: float | None
    window: int | None  # keys with q_pos - k_pos < window are visible
    tiled_prefill: bool  # bf16 on CPU: query tiles beat torch's fused kernel 2.5-3x
    # The native attention kernels (bf16 on an AVX512-BF16 CPU, plain layers), both reading
    # the pool in place: decode 5-6x the gather and two bmm's it replaces (native/attention.c);
    # prefill flash-style, 1.6-2.1x the tiled path with or without earlier context
    # (native/prefill.c).
    native: Kernels | None = None

    @property
    def plain(self) -> bool:
        return self.softcap is None and self.window is None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch,
                    cfg: AttentionConfig) -> torch.Tensor:
    """``q [T, nq, d]``, fresh ``k``/``v [T, nkv, d]`` (already written to the pool)."""
    groups = batch.decode_groups
    if not batch.prefills and len(groups) == 1:  # the usual decode step: no copy into `out`
        return _decodes(q, k_cache, v_cache, groups[0], cfg)
    out = torch.empty_like(q)
    for g in batch.decode_groups:
        end = g.first + g.count
        out[g.first:end] = _decodes(q[g.first:end], k_cache, v_cache, g, cfg)
    for index, (first, length, context, table, mask) in enumerate(batch.prefills):
        if cfg.native is not None and cfg.plain and table is not None:
            out[first:first + length] = cfg.native.prefill_attention(
                q[first:first + length], k_cache, v_cache, table, context, cfg.scale)
            continue
        qi = q[first:first + length].transpose(0, 1)
        if context == 0 or table is None:
            ki = k[first:first + length].transpose(0, 1)
            vi = v[first:first + length].transpose(0, 1)
        else:
            ki = gather(k_cache, table.unsqueeze(0))[:, 0, :context + length]
            vi = gather(v_cache, table.unsqueeze(0))[:, 0, :context + length]
        if not cfg.plain:
            key = (index, cfg.window)
            if key not in batch.prefill_masks:
                batch.prefill_masks[key] = prefill_mask(context, length, cfg.window, q.device)
            o = masked_attention(qi, ki, vi, batch.prefill_masks[key], cfg)
        elif cfg.tiled_prefill:
            o = tiled_causal_attention(qi, ki, vi, context, cfg.scale)
        else:
            # 4-D inputs select torch's fused attention kernel (3-D ones do not).
            o = F.scaled_dot_product_attention(
                qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), attn_mask=mask,
                is_causal=mask is None, enable_gqa=True, scale=cfg.scale)[0]
        out[first:first + length] = o.transpose(0, 1)
    return out


def _decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
             cfg: AttentionConfig) -> torch.Tensor:
    if cfg.native is not None and cfg.plain:
        return cfg.native.decode_attention(q, k_cache, v_cache, g.block_tables, g.lengths,
                                           cfg.scale)
    return decode_attention(q, gather(k_cache, g.block_tables), gather(v_cache, g.block_tables),
                            _decode_mask(g, cfg.window), cfg)


def _decode_mask(g: DecodeGroup, window: int | None) -> torch.Tensor:
    """The keys each of the group's queries may not see (True = hidden)."""
    if window not in g.hidden_masks:
        visible = g.mask
        if window is not None:
            span = torch.arange(g.mask.shape[-1], device=g.mask.device)
            recent = span[None, :] > (g.lengths - 1 - window)[:, None]
            visible = visible & recent[None, :, None, :]
        g.hidden_masks[window] = ~visible
    return g.hidden_masks[window]


def prefill_mask(context: int, length: int, window: int | None,
                 device: torch.device) -> torch.Tensor:
    """``[length, context + length]`` bool: causal, and within the window if there is one."""
    q_pos = torch.arange(context, context + length, device=device)[:, None]
    k_pos = torch.arange(context + length, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, cfg: AttentionConfig) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * cfg.scale
    if cfg.softcap is not None:
        scores = torch.tanh(scores / cfg.softcap) * cfg.softcap
    return scores


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                     cfg: AttentionConfig) -> torch.Tensor:
    """One query per sequence: two batched matmuls beat SDPA's masked path ~10x here.
    ``hidden`` is True for the keys a query may not see.

    ``k``/``v`` are ``[kv_heads, seqs, len, d]``; keeping kv heads outermost lets both
    matmuls read the gathered KV in place, with no transposing copy.
    """
    nd, nq, d = q.shape
    nkv = k.shape[0]
    qg = q.view(nd, nkv, nq // nkv, d).transpose(0, 1)
    if cfg.softcap is None:
        scores = torch.matmul(qg * cfg.scale, k.transpose(-1, -2))
    else:
        scores = _scores(qg, k, cfg)
    # softmax accumulates in fp32 internally whatever the dtype; no casts needed.
    probs = scores.masked_fill_(hidden, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).reshape(nd, nq, d)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     cfg: AttentionConfig) -> torch.Tensor:
    """``q [nq, L, d]`` over ``k``/``v [nkv, S, d]`` with a ``[L, S]`` mask, as transformers'
    eager attention computes it (scale after q.k, soft-cap, fp32 softmax)."""
    nq, length, d = q.shape
    nkv = k.shape[0]
    qg = q.view(nkv, nq // nkv, length, d)
    scores = _scores(qg, k.unsqueeze(1), cfg).masked_fill_(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(1)).view(nq, length, d)


def tiled_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int,
                           scale: float, tile: int = 64) -> torch.Tensor:
    """Causal attention of queries at positions ``context..`` over ``[nkv, context+L, d]`` keys.

    Each query tile only multiplies against the keys it can see, so the causal half of the
    score matrix is never computed, and each tile's scores stay cache-resident.
    """
    nq, length, d = q.shape
    nkv = k.shape[0]
    group = nq // nkv
    out = torch.empty_like(q)
    scaled = (q * scale).view(nkv, group, length, d)
    causal = torch.ones(tile, tile, dtype=torch.bool, device=q.device).triu(1)
    for start in range(0, length, tile):
        end = min(start + tile, length)
        t = end - start
        seen = context + end
        scores = torch.matmul(scaled[:, :, start:end].reshape(nkv, group * t, d),
                              k[:, :seen].transpose(-1, -2))
        scores[:, :, context + start:seen].view(nkv, group, t, t).masked_fill_(
            causal[:t, :t], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[:, start:end] = torch.matmul(probs, v[:, :seen]).view(nkv, group, t, d).reshape(
            nq, t, d)
    return out


def gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[B, max_blocks]`` block tables -> ``[kv_heads, B, max_blocks * block_size, head_dim]``.

    ``index_select`` copies whole blocks with memcpy; advanced indexing ran 5x slower here.
    """
    b, nb = tables.shape
    nkv, _, bs, d = cache.shape
    return cache.index_select(1, tables.flatten()).view(nkv, b, nb * bs, d)
