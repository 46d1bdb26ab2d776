"""The generic path: model types no family module reads run through transformers' own forward
with attention over the paged pool. Token identity per family lives in test_families.py
(GENERIC_FAMILIES); here: that those really take the generic path, the registry's fallback, and
one clear refusal for each thing the generic attention cannot honour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from family_models import COMMON, GENERIC_FAMILIES, build_family_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from cleave.runtime.engine.families.generic import GenericSpec
from cleave.runtime.engine.families.registry import read_spec
from cleave.runtime.engine.families.spec import UnsupportedModelError
from cleave.runtime.engine.generic.attention import CallRecord
from cleave.runtime.engine.generic.model import GenericCausalLM, check_calls
from cleave.runtime.engine.kv_layout import KVLayout
from cleave.runtime.engine.models import build_model


def test_generic_families_take_the_generic_path(tmp_path: Path) -> None:
    from cleave.runtime.engine.config import EngineConfig
    from cleave.runtime.engine.llm_engine import LLMEngine

    directory = build_family_model("starcoder2", tmp_path / "starcoder2")
    engine = LLMEngine(EngineConfig(model=str(directory), dtype="float32", device="cpu",
                                    kv_cache_bytes=1 << 20, block_size=4),
                       progress=lambda _: None)
    assert isinstance(engine.model, GenericCausalLM)
    # The layout the probe forward saw: 2 layers of 2 KV heads of 16 (GQA kept, not repeated).
    assert engine.model.kv_layout == KVLayout(2, 2, 16)
    assert "starcoder2" in GENERIC_FAMILIES


@pytest.mark.parametrize("family", ["starcoder2", "mixtral"])
def test_prefill_decode_handoff_on_generic_and_moe_models(family: str, tmp_path: Path) -> None:
    # The pool the generic attention (and the experts' decoder) writes is what the handoff
    # exports: a decode engine continuing from it matches one engine doing both.
    from cleave.runtime.engine.config import EngineConfig
    from cleave.runtime.engine.llm_engine import LLMEngine
    from cleave.runtime.engine.sequence import FinishReason, SamplingParams

    directory = build_family_model(family, tmp_path / family)

    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(directory), dtype="float32", device="cpu",
                                      kv_cache_bytes=1 << 20, block_size=4),
                         progress=lambda _: None)

    single, prefill, decode = engine(), engine(), engine()
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = list(range(5, 35))
    [want] = single.generate([prompt], greedy)
    prefill.add_request("p", prompt, greedy, prefill_only=True)
    outs = []
    while prefill.has_unfinished:
        outs += prefill.step()
    [done] = outs
    assert done.finish_reason is FinishReason.PREFILL_DONE and done.handoff is not None
    decode.add_request("d", prompt, greedy, kv=done.handoff)
    got = [done.handoff.first_token]
    while decode.has_unfinished:
        for o in decode.step():
            got += o.new_token_ids
    assert got == want.token_ids
    assert decode.stats.prompt_tokens_computed == len(prompt) % 4  # the blocks were reused
    assert len(set(got)) > 3


def _config(model_type: str, **extra: Any) -> Any:
    return AutoConfig.for_model(model_type, **{**COMMON, "vocab_size": 64, **extra})


def test_registry_falls_back_only_with_transformers_causal_lm_classes() -> None:
    spec = read_spec(_config("olmo2"), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert isinstance(spec, GenericSpec) and spec.causal_lm_class == "Olmo2ForCausalLM"
    assert spec.shape.num_layers == 2 and spec.shape.max_position_embeddings == 256
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'olmo2'"):
        read_spec(_config("olmo2"))  # no class names given: no fallback
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        read_spec(AutoConfig.for_model("falcon", alibi=True), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize(("model_type", "extra", "message"), [
    ("gpt_oss", {"num_local_experts": 4}, "uses attention sinks"),
    ("bert", {}, "bidirectional"),
    ("stablelm", {}, "does not run attention through transformers' AttentionInterface"),
    ("mamba", {}, "recurrent or state-space"),
])
def test_what_the_generic_attention_cannot_honour_is_refused(
        model_type: str, extra: dict[str, Any], message: str) -> None:
    cfg = _config(model_type, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state = AutoModelForCausalLM.from_config(cfg).state_dict()
    with pytest.raises(UnsupportedModelError, match=message):
        build_model(cfg, state, torch.float32, torch.device("cpu"))


def test_a_checkpoint_that_does_not_fit_the_class_is_refused(tmp_path: Path) -> None:
    # A Llama checkpoint relabelled gpt2: transformers would serve random weights, with a warning.
    import json

    from cleave.runtime.engine.config import EngineConfig
    from cleave.runtime.engine.llm_engine import LLMEngine

    directory = build_family_model("qwen3", tmp_path / "qwen3")
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=2, n_head=4,
                  n_embd=64, n_positions=256)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="does not fit GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(directory), dtype="float32", device="cpu",
                               kv_cache_bytes=1 << 20), progress=lambda _: None)


def _calls(n: int, **changes: Any) -> list[CallRecord]:
    fields: dict[str, Any] = {"num_kv_heads": 2, "head_dim": 16, "window": None,
                              "cross": False, "refused": None}
    return [CallRecord(**fields)] * (n - 1) + [CallRecord(**{**fields, **changes})]


@pytest.mark.parametrize(("calls", "cfg_extra", "message"), [
    (_calls(1), {}, "ran attention 1 times for 2 layers"),
    (_calls(2, num_kv_heads=4), {}, "differ in KV heads"),
    (_calls(2, cross=True), {}, "cross-attention"),
    (_calls(2), {"sliding_window": 8}, "sliding window that its attention applies only"),
])
def test_probe_records_are_checked(calls: list[CallRecord], cfg_extra: dict[str, Any],
                                   message: str) -> None:
    cfg = _config("olmo2", **cfg_extra)
    spec = read_spec(cfg, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert isinstance(spec, GenericSpec)
    assert check_calls(_calls(2), spec, _config("olmo2")) == KVLayout(2, 2, 16)
    with pytest.raises(UnsupportedModelError, match=message):
        check_calls(calls, spec, cfg)
