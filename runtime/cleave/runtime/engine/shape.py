"""A dense decoder's dimensions, read from its Hugging Face config: torch-free, so the router
(which loads only the config and the tokenizer) can size requests without the engine.

What differs between families (norms, rotary variants, windows) lives in
:mod:`cleave.runtime.engine.families`; this is only what every family has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cleave.runtime.engine.kv_layout import KVLayout


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelShape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim)

    def param_count(self, include_embeddings: bool = True) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        total = self.num_layers * layer + h
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total
