"""One end-to-end check on the real default model (SmolLM2-135M-Instruct from its wheel)."""

from __future__ import annotations

import pytest
import torch
from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sequence import SamplingParams
from conftest import hf_greedy

pytestmark = pytest.mark.slow


def test_smollm2_greedy_matches_transformers_fp32() -> None:
    from transformers import AutoModelForCausalLM

    messages: list[str] = []
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=1 << 28),
                       progress=messages.append)
    assert any("model ready" in m for m in messages), "loading reports progress"
    reference = AutoModelForCausalLM.from_pretrained(
        str(engine.model_files.directory), dtype=torch.float32).eval()
    prompts = [
        engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        engine.tokenize("The three primary colors are"),
        engine.tokenize("def fibonacci(n):\n    " * 6),
    ]
    results = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(reference, prompt, 16)
    assert "Paris" in results[0].text
