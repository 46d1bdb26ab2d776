"""A Llama-family forward pass over the paged KV pool.

Weights come from a transformers checkpoint (same names, same math), fused where that saves
kernel launches: q/k/v in one matmul, gate/up in one. Logits match transformers' reference
forward (tests check it token for token in fp32). Attention reads a sequence's KV through its
block table; decodes of the whole batch share one gathered, masked SDPA call, and a prefill
chunk with no earlier context attends over its own fresh K/V without touching the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf_config(cls, cfg: Any) -> LlamaShape:
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope scaling '{rope_type}' is not supported yet")
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            raise ValueError("sliding-window attention is not supported yet")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2")),
        )

    def param_count(self, include_embeddings: bool = True) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        total = self.num_layers * layer + h
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class DecodeGroup:
    """Decode tokens ``[first, first + count)``, attended in one padded batch."""

    first: int
    count: int
    block_tables: torch.Tensor  # [count, max_blocks]
    mask: torch.Tensor  # [1, count, 1, max_blocks * block_size] bool, True = attend


@dataclass
class AttentionBatch:
    """How the flat token batch of one step maps onto sequences and the pool.

    Decode tokens come first (one per sequence), prefill chunks after them.
    """

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat index into the pool's (block, offset) slots
    decode_groups: list[DecodeGroup]
    # One entry per prefill chunk: (first token in batch, length, context before the chunk,
    # block table [n_blocks] when the chunk attends over earlier context, causal mask).
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]
    logits_indices: torch.Tensor  # [S] batch positions whose logits are sampled


class PagedLlama:
    def __init__(self, shape: LlamaShape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.final_norm = w("model.norm.weight")
        self.lm_head = self.embed if shape.tie_word_embeddings else w("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            bias = None
            if shape.attention_bias:
                bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=bias,
                o_proj=w(p + "self_attn.o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=w(p + "mlp.down_proj.weight"),
            ))
        inv_freq = 1.0 / (shape.rope_theta ** (
            torch.arange(0, shape.head_dim, 2, dtype=torch.int64, device=device).float()
            / shape.head_dim))
        t = torch.arange(shape.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # transformers computes cos/sin in fp32 and casts to the activation dtype; so do we.
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        # torch's fused CPU attention runs bf16 at ~60 GFLOP/s here; query tiles of 64 over
        # two matmuls run 2.5-3x faster (bench/engine.py). fp32 and CUDA keep SDPA.
        self.tiled_prefill = device.type == "cpu" and dtype == torch.bfloat16

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv, layer.o_proj, layer.post_norm,
                        layer.gate_up, layer.down]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as transformers' LlamaRMSNorm does, so fp32 logits match exactly.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch,
                k_pool: list[torch.Tensor], v_pool: list[torch.Tensor]) -> torch.Tensor:
        """Run one step; returns fp32 logits for ``batch.logits_indices``.

        ``k_pool[l]`` / ``v_pool[l]`` are ``[kv_heads, num_blocks, block_size, head_dim]``.
        """
        s = self.shape
        nq, nkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        num_tokens = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[batch.positions].unsqueeze(1)
        sin = self.sin[batch.positions].unsqueeze(1)
        for layer, k_cache, v_cache in zip(self.layers, k_pool, v_pool, strict=True):
            x = self._rms_norm(h, layer.input_norm)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = torch.split(qkv, [nq * d, nkv * d, nkv * d], dim=-1)
            q = self._rope(q.view(num_tokens, nq, d), cos, sin)
            k = self._rope(k.view(num_tokens, nkv, d), cos, sin)
            v = v.view(num_tokens, nkv, d)
            k_cache.view(nkv, -1, d).index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
            v_cache.view(nkv, -1, d).index_copy_(1, batch.slot_mapping, v.transpose(0, 1))
            attn = self._attention(q, k, v, k_cache, v_cache, batch)
            h = h + F.linear(attn.reshape(num_tokens, nq * d), layer.o_proj)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        h = self._rms_norm(h[batch.logits_indices], self.final_norm)
        return F.linear(h, self.lm_head).float()

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   batch: AttentionBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        for g in batch.decode_groups:
            end = g.first + g.count
            out[g.first:end] = self._decode_attention(
                q[g.first:end], _gather(k_cache, g.block_tables),
                _gather(v_cache, g.block_tables), g.mask)
        for first, length, context, table, mask in batch.prefills:
            qi = q[first:first + length].transpose(0, 1)
            if table is None:
                ki = k[first:first + length].transpose(0, 1)
                vi = v[first:first + length].transpose(0, 1)
            else:
                ki = _gather(k_cache, table.unsqueeze(0))[:, 0, :context + length]
                vi = _gather(v_cache, table.unsqueeze(0))[:, 0, :context + length]
            if self.tiled_prefill:
                o = _tiled_causal_attention(qi, ki, vi, context)
            else:
                # 4-D inputs select torch's fused attention kernel (3-D ones do not).
                o = F.scaled_dot_product_attention(
                    qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), attn_mask=mask,
                    is_causal=table is None, enable_gqa=True)[0]
            out[first:first + length] = o.transpose(0, 1)
        return out

    def _decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
        """One query per sequence: two batched matmuls beat SDPA's masked path ~10x here.

        ``k``/``v`` are ``[kv_heads, seqs, len, d]``; keeping kv heads outermost lets both
        matmuls read the gathered KV in place, with no transposing copy.
        """
        nd, nq, d = q.shape
        nkv = k.shape[0]
        qg = q.view(nd, nkv, nq // nkv, d).transpose(0, 1)
        scores = torch.matmul(qg * d ** -0.5, k.transpose(-1, -2))
        # softmax accumulates in fp32 internally whatever the dtype; no casts needed.
        probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
        return torch.matmul(probs, v).transpose(0, 1).reshape(nd, nq, d)


def _tiled_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int,
                            tile: int = 64) -> torch.Tensor:
    """Causal attention of queries at positions ``context..`` over ``[nkv, context+L, d]`` keys.

    Each query tile only multiplies against the keys it can see, so the causal half of the
    score matrix is never computed, and each tile's scores stay cache-resident.
    """
    nq, length, d = q.shape
    nkv = k.shape[0]
    group = nq // nkv
    out = torch.empty_like(q)
    scaled = (q * d ** -0.5).view(nkv, group, length, d)
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


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[B, max_blocks]`` block tables -> ``[kv_heads, B, max_blocks * block_size, head_dim]``.

    ``index_select`` copies whole blocks with memcpy; advanced indexing ran 5x slower here.
    """
    b, nb = tables.shape
    nkv, _, bs, d = cache.shape
    return cache.index_select(1, tables.flatten()).view(nkv, b, nb * bs, d)
