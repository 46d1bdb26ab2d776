"""The generic path's half of the registry: a model type no family module reads, served through
transformers' own forward with attention over the paged pool (``engine/generic``).

Torch- and transformers-free like the rest of the registry: the caller hands in transformers'
``model_type -> causal LM class`` names (the loader and the engine have transformers; this
module only decides). What the forward alone reveals (layers without attention, non-uniform KV
heads, attention sinks) is refused when the model is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cleave.runtime.engine.families.spec import UnsupportedModelError
from cleave.runtime.engine.shape import ModelShape

# Causal LM heads under both of transformers' naming schemes (GPT2LMHeadModel is the old one).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
# Context-length fields, most specific first, under the names older configs still use.
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True)
class GenericSpec:
    model_type: str
    shape: ModelShape  # from the config, for sizing; the KV layout comes from the forward
    causal_lm_class: str  # transformers' class for this model_type


def causal_lm_class(model_type: str, classes: Mapping[str, str]) -> str | None:
    """Transformers' causal LM class for ``model_type``, None where it has none (a
    ``*ForConditionalGeneration`` is a multimodal model, not a text causal LM)."""
    name = classes.get(model_type)
    return name if name is not None and name.endswith(CAUSAL_LM_SUFFIXES) else None


def read_generic(cfg: Any, class_name: str) -> GenericSpec:
    for arch in getattr(cfg, "architectures", None) or []:
        if not arch.endswith(CAUSAL_LM_SUFFIXES):
            raise UnsupportedModelError(
                f"architecture '{arch}' is not a causal language model (needs *ForCausalLM)")
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"'{cfg.model_type}' is an encoder-decoder: cross-attention is not supported")
    if getattr(cfg, "alibi", False):
        raise UnsupportedModelError(
            f"'{cfg.model_type}' uses ALiBi position biases, which the generic paged attention "
            "does not apply")
    return GenericSpec(model_type=cfg.model_type, shape=generic_shape(cfg),
                       causal_lm_class=class_name)


def generic_shape(cfg: Any) -> ModelShape:
    """A :class:`ModelShape` from whatever a config calls its sizes (transformers' attribute
    maps give most configs the standard names)."""
    hidden = _first(cfg, ("hidden_size",), "a hidden size")
    heads = _first(cfg, ("num_attention_heads",), "an attention head count")
    return ModelShape(
        vocab_size=_first(cfg, ("vocab_size",), "a vocabulary size"),
        hidden_size=hidden,
        intermediate_size=getattr(cfg, "intermediate_size", None) or 4 * hidden,
        num_layers=_first(cfg, ("num_hidden_layers",), "a layer count"),
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
        max_position_embeddings=_first(cfg, _CONTEXT_FIELDS, "a maximum context length"),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))


def _first(cfg: Any, fields: tuple[str, ...], what: str) -> int:
    for name in fields:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise UnsupportedModelError(f"the config gives no {what} ({' / '.join(fields)})")
