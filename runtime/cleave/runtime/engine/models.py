"""The torch half of the model registry: builds the :class:`PagedModel` for a spec that
:func:`cleave.runtime.engine.families.registry.read_spec` produced from a Hugging Face config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from cleave.runtime.engine.dense.decoder import PagedDecoder
from cleave.runtime.engine.families.generic import GenericSpec
from cleave.runtime.engine.families.registry import FAMILIES, read_spec
from cleave.runtime.engine.families.spec import DecoderSpec, UnsupportedModelError
from cleave.runtime.engine.paged_model import PagedModel
from cleave.runtime.engine.parallel.shard import Shard, TensorParallelError, check_divides

Builder = Callable[[DecoderSpec, Any, dict[str, torch.Tensor], torch.dtype, torch.device,
                    Shard | None], PagedModel]

# Every family registered today runs the dense decoder (mixture-of-experts ones with their
# experts part); a family with a forward of its own registers its builder here.
BUILDERS: dict[str, Builder] = dict.fromkeys(FAMILIES, PagedDecoder)


def check_parallel(hf_config: Any, size: int) -> None:
    """Refuse, before weights load or ranks start, a model ``size`` ranks cannot split."""
    spec = read_spec(hf_config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if isinstance(spec, GenericSpec):
        if size > 1:
            raise TensorParallelError(
                f"tensor parallelism is not supported on the generic path ('{spec.model_type}' "
                "runs through transformers' own forward): serve it with --tensor-parallel-size 1")
        return
    check_divides(spec.shape, size)


def build_model(hf_config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device, shard: Shard | None = None) -> PagedModel:
    """The model, or with ``shard`` one tensor-parallel rank's part of it."""
    spec = read_spec(hf_config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if shard is not None:
        check_parallel(hf_config, shard.size)
    if isinstance(spec, GenericSpec):  # any other causal LM: transformers' forward, paged KV
        from cleave.runtime.engine.generic.model import GenericCausalLM

        return GenericCausalLM(spec, hf_config, state, dtype, device)
    builder = BUILDERS.get(spec.model_type)
    if builder is None:
        raise UnsupportedModelError(f"no forward registered for '{spec.model_type}'")
    return builder(spec, hf_config, state, dtype, device, shard)
