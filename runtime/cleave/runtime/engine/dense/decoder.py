"""The dense decoder forward over the paged KV pool, assembled from a family's spec.

Same math as transformers' reference forward for each family (tests check it token for token
in fp32): embeddings (optionally scaled), per layer a pre-norm attention block (optional q/k
norm, rotary, windowed/soft-capped attention, optional post-norm) and MLP block, a final norm,
the LM head and an optional logit soft-cap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cleave.runtime.engine.dense import native_layers
from cleave.runtime.engine.dense.attention import AttentionConfig, paged_attention
from cleave.runtime.engine.dense.linear import Linear
from cleave.runtime.engine.dense.norms import RMSNorm
from cleave.runtime.engine.dense.rotary import RotaryTable, apply_rotary
from cleave.runtime.engine.dense.weights import LayerWeights, load_layer
from cleave.runtime.engine.families.spec import DecoderSpec, RopeSpec
from cleave.runtime.engine.kv_layout import KVLayout
from cleave.runtime.engine.native.kernels import Kernels, kernels
from cleave.runtime.engine.paged_model import AttentionBatch
from cleave.runtime.engine.parallel.shard import Shard

# Keys match families.spec.ACTIVATIONS, which refuses any other before weights load.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class PagedDecoder:
    """One :class:`~cleave.runtime.engine.paged_model.PagedModel` for every dense family.

    With ``shard`` it is one tensor-parallel rank's part (:mod:`..parallel`): its own heads and
    intermediate slice, an all-reduce after o_proj and after the MLP; the KV pool it is handed
    holds its own KV heads only.
    """

    def __init__(self, spec: DecoderSpec, hf_config: Any, state: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, shard: Shard | None = None) -> None:
        self.spec = spec
        self.shape = spec.shape
        self._dtype = dtype
        self._device = device
        self.shard = shard
        ranks = 1 if shard is None else shard.size
        self.nq, self.nkv = spec.shape.num_heads // ranks, spec.shape.num_kv_heads // ranks
        self.act = _ACTIVATIONS[spec.hidden_act]

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=device, dtype=dtype).contiguous()

        # Gemma rounds sqrt(hidden) to the activation dtype before multiplying.
        self.embed_scale = (None if spec.embed_scale is None
                            else torch.tensor(spec.embed_scale, dtype=dtype, device=device))
        self.final_norm = RMSNorm(w("model.norm.weight"), spec.rms_norm_eps, spec.norm_offset)
        # tied: the embeddings are the head's rows, looked up in whatever layout it keeps them
        tied = spec.shape.tie_word_embeddings
        self.head = Linear(w("model.embed_tokens.weight" if tied else "lm_head.weight"),
                           prepack=False)
        self.embed = None if tied else w("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = [load_layer(spec, i, w, self.act, shard)
                                           for i in range(spec.shape.num_layers)]
        self._tables: dict[RopeSpec, RotaryTable] = {}
        for layer in spec.layers:
            if layer.rope not in self._tables:
                self._tables[layer.rope] = RotaryTable(
                    layer.rope, hf_config, spec.shape.max_position_embeddings, dtype, device)
        tiled = device.type == "cpu" and dtype == torch.bfloat16
        scale = spec.attn_scale if spec.attn_scale is not None else spec.shape.head_dim ** -0.5
        native = (kernels() if Kernels.takes_decode_attention(
            self.nq, self.nkv, spec.shape.head_dim, dtype, device) else None)
        self.attention = [AttentionConfig(scale, spec.attn_softcap, layer.sliding_window, tiled,
                                          native) for layer in spec.layers]
        ropes = {layer.rope for layer in spec.layers}
        full_rotary = all(rope.rotary_dim == spec.shape.head_dim for rope in ropes)
        self.native_rotary = (kernels() if full_rotary and self.layers[0].qkv.native is not None
                              and Kernels.takes_head_dim(spec.shape.head_dim) else None)
        self.native_layers = native_layers.build(
            native, self.layers, self.attention, self.nq, self.nkv, spec.shape.head_dim,
            spec.rms_norm_eps, eligible=len(ropes) == 1 and full_rotary and shard is None)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def kv_layout(self) -> KVLayout:
        """The whole model's (what the store's blocks and the fingerprint describe), also on a
        tensor-parallel rank, whose pool holds ``shard.local_layout`` of it."""
        return self.shape.kv_layout

    def weight_bytes(self) -> int:
        total = self.head.nbytes() + self.final_norm.nbytes()
        if self.embed is not None:
            total += self.embed.numel() * self.embed.element_size()
        return total + sum(layer.nbytes() for layer in self.layers)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch,
                k_pool: list[torch.Tensor], v_pool: list[torch.Tensor]) -> torch.Tensor:
        h = (self.head.lookup(input_ids) if self.embed is None
             else F.embedding(input_ids, self.embed))
        if self.embed_scale is not None:
            h = h * self.embed_scale
        rotary = {key: table.at(batch.positions) for key, table in self._tables.items()}
        if self.native_layers is not None and self.native_layers.takes(batch, h.shape[0]):
            cos, sin = rotary[self.spec.layers[0].rope]
            h = self.native_layers.run(h, batch, cos, sin, k_pool, v_pool)
        else:
            for i, (layer, k_cache, v_cache) in enumerate(
                    zip(self.layers, k_pool, v_pool, strict=True)):
                cos, sin = rotary[self.spec.layers[i].rope]
                h = self._layer(h, layer, self.attention[i], cos, sin, k_cache, v_cache, batch)
        h = self.final_norm(h[batch.logits_indices])
        logits = self.head(h)
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _layer(self, h: torch.Tensor, layer: LayerWeights, attn_cfg: AttentionConfig,
               cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        nq, nkv, d = self.nq, self.nkv, self.shape.head_dim
        num_tokens = h.shape[0]
        qkv = layer.qkv(layer.attn_in_norm(h))
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k, v = torch.split(qkv, [nq * d, nkv * d, nkv * d], dim=-1)
            q = apply_rotary(layer.q_norm(q.view(num_tokens, nq, d)), cos, sin)
            k = apply_rotary(layer.k_norm(k.view(num_tokens, nkv, d)), cos, sin)
        elif self.native_rotary is not None and Kernels.takes_rows(qkv, d):
            # q and k rotated in place, one call (the same roundings as apply_rotary)
            self.native_rotary.rotary_(qkv, nq + nkv, d, cos.view(num_tokens, d),
                                       sin.view(num_tokens, d))
            q = qkv[:, :nq * d].view(num_tokens, nq, d)
            k = qkv[:, nq * d:(nq + nkv) * d].view(num_tokens, nkv, d)
            v = qkv[:, (nq + nkv) * d:]
        else:  # q and k rotated together: one set of ops instead of two
            qk = apply_rotary(qkv[:, :(nq + nkv) * d].view(num_tokens, nq + nkv, d), cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
            v = qkv[:, (nq + nkv) * d:]
        v = v.view(num_tokens, nkv, d)
        k_cache.view(nkv, -1, d).index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
        v_cache.view(nkv, -1, d).index_copy_(1, batch.slot_mapping, v.transpose(0, 1))
        attn = paged_attention(q, k, v, k_cache, v_cache, batch, attn_cfg)
        out = layer.o_proj(attn.reshape(num_tokens, nq * d))
        if self.shard is not None:  # row-parallel: sum the ranks' partial products
            dist.all_reduce(out)
        if layer.attn_out_norm is not None:
            out = layer.attn_out_norm(out)
        h = h + out
        out = layer.mlp(layer.mlp_in_norm(h))
        if self.shard is not None:
            dist.all_reduce(out)
        if layer.mlp_out_norm is not None:
            out = layer.mlp_out_norm(out)
        return h + out
