"""Which Hugging Face ``model_type`` the engine serves, and how each is read.

Torch-free: the loader asks :func:`read_spec` whether a checkpoint is servable (and what its KV
layout is) before any weights load; the torch side (:mod:`cleave.runtime.engine.models`) builds
the model from the same spec. A model type no family reads falls back to the generic path
(:mod:`.generic`) when transformers has a causal LM class for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cleave.runtime.engine.families.gemma import read_gemma2, read_gemma3_text
from cleave.runtime.engine.families.generic import GenericSpec, causal_lm_class, read_generic
from cleave.runtime.engine.families.llama import read_llama, read_mistral
from cleave.runtime.engine.families.moe import read_mixtral, read_qwen3_moe
from cleave.runtime.engine.families.phi3 import read_phi3
from cleave.runtime.engine.families.qwen import read_qwen2, read_qwen3
from cleave.runtime.engine.families.spec import (
    DecoderSpec,
    UnsupportedModelError,
    check_architectures,
    check_dense_text,
)
from cleave.runtime.engine.kv_layout import KVLayout

FAMILIES: dict[str, Callable[[Any], DecoderSpec]] = {
    "llama": read_llama,
    "mistral": read_mistral,
    "qwen2": read_qwen2,
    "qwen3": read_qwen3,
    "gemma2": read_gemma2,
    "gemma3_text": read_gemma3_text,
    "phi3": read_phi3,
    "mixtral": read_mixtral,
    "qwen3_moe": read_qwen3_moe,
}
SUPPORTED_MODEL_TYPES = frozenset(FAMILIES)
ModelSpec = DecoderSpec | GenericSpec


def is_supported(model_type: str) -> bool:
    return model_type in FAMILIES


def read_spec(cfg: Any, causal_lm_classes: Mapping[str, str] | None = None) -> ModelSpec:
    """The decoder a Hugging Face config describes; :class:`UnsupportedModelError` names what
    the engine lacks when it cannot serve it. ``causal_lm_classes`` (transformers'
    ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) enables the generic path for other model types."""
    model_type = getattr(cfg, "model_type", None) or "unknown"
    check_dense_text(cfg)  # a vision tower or quantization says more than the type alone
    reader = FAMILIES.get(model_type)
    if reader is None:
        class_name = causal_lm_class(model_type, causal_lm_classes or {})
        if class_name is None:
            raise UnsupportedModelError(
                f"unsupported architecture '{model_type}': no family reads it and transformers "
                f"has no causal LM class for it (families: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
        return read_generic(cfg, class_name)
    check_architectures(cfg)  # e.g. a sequence classifier of a supported family
    return reader(cfg)


def kv_layout(cfg: Any) -> KVLayout:
    return read_spec(cfg).shape.kv_layout
