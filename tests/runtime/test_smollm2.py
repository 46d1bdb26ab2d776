"""One end-to-end check on the real default model (SmolLM2-135M-Instruct from its wheel)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_reference import hf_greedy

from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.paged_model import AttentionBatch
from cleave.runtime.engine.sequence import SamplingParams

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


def test_default_model_by_name_or_by_path_is_one_identity() -> None:
    from cleave.runtime.models.loader import DEFAULT_MODEL, _default_gguf, resolve_model

    gguf, _ = _default_gguf()
    by_name = resolve_model(DEFAULT_MODEL)
    by_path = resolve_model(str(gguf))
    assert by_name.weights_digest == by_path.weights_digest
    assert len(by_name.weights_digest) == 64  # hex sha256 of the file, as RECORD states
    assert by_name.directory == by_path.directory  # converted once, shared


def test_a_prompt_longer_than_the_step_budget_alone_completes_on_the_native_path() -> None:
    """Its first chunk runs alone and needs no logits: the LM head gets no rows (which trapped
    in gemm.c, killing the worker, for any prompt over 512 tokens on an idle bf16 CPU
    worker). The greedy tokens match those of the op-by-op path."""
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_bytes=1 << 26,
                                    max_num_batched_tokens=64), progress=lambda _: None)
    if getattr(engine.model, "native_layers", None) is None:
        pytest.skip("native kernels unavailable here (no AVX512-BF16 or no C compiler)")
    prompt = engine.tokenize("def fibonacci(n):\n    " * 20)  # 140 tokens: three chunks
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    [native] = engine.generate([prompt], params)
    assert len(native.token_ids) == 4
    engine.model.native_layers = None  # type: ignore[attr-defined]
    engine.block_manager.reset_prefix_cache()
    assert engine.generate([prompt], params)[0].token_ids == native.token_ids


def test_bf16_native_layers_give_the_op_by_op_paths_tokens() -> None:
    """bf16 on a CPU with the native kernels: every step runs each layer in one native call
    (dense/native_layers.py) instead of the same kernels called op by op from Python. Both
    round alike, so the same prompts give the same greedy tokens either way. A 96-token step
    budget makes every kind of step: prompts cut into chunks over earlier context, decodes
    riding along with chunks, and decode-only steps of all 40 sequences (no row limit).
    (Each kernel against torch's ops: test_native_kernels.py, test_native_linear.py.)"""
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_bytes=1 << 28,
                                    max_num_batched_tokens=96), progress=lambda _: None)
    model = engine.model
    native = getattr(model, "native_layers", None)
    if native is None:
        pytest.skip("native kernels unavailable here (no AVX512-BF16 or no C compiler)")
    prompts = [
        engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        engine.tokenize("The three primary colors are"),
        engine.tokenize("def fibonacci(n):\n    " * 20),  # 140 tokens: two chunks at least
        *(engine.tokenize(f"Count from {i} to {i + 9}:") for i in range(37)),
    ]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kinds: set[str] = set()
    real_run = native.run

    def counted(h: torch.Tensor, batch: AttentionBatch, *args: Any) -> torch.Tensor:
        decodes = sum(g.count for g in batch.decode_groups)
        kinds.add("decode-only" if not batch.prefills else "mixed" if decodes else "prefill")
        if any(context for _, _, context, *_ in batch.prefills):
            kinds.add("chunk over context")
        if decodes == len(prompts):
            kinds.add("all decoding")
        return real_run(h, batch, *args)

    native.run = counted  # type: ignore[method-assign]
    with_native = [r.token_ids for r in engine.generate(prompts, params)]
    assert kinds == {"decode-only", "mixed", "prefill", "chunk over context", "all decoding"}
    model.native_layers = None  # type: ignore[attr-defined]
    engine.block_manager.reset_prefix_cache()  # recompute the prompts too
    without = [r.token_ids for r in engine.generate(prompts, params)]
    assert with_native == without
