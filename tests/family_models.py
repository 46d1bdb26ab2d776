"""Tiny random checkpoints of each supported model family, built offline from transformers'
own config classes, and the token-identity check the tests and ``bench/engine.py`` run on them.

Every model: hidden 64, 4 query heads and 2 KV heads of 16 dims, 2 layers, the tiny tokenizer
of ``tiny_model.py``, random weights with norm weights perturbed too (so a wrong norm rounding or
(1 + w) offset shows). Sliding windows are 12 tokens: with 4-token blocks a window spans blocks,
and prompts plus 24 generated tokens run well past it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch
from hf_reference import hf_greedy
from tiny_model import build_tiny_tokenizer
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Starcoder2Config,
)

WINDOW: Final = 12
BLOCK_SIZE: Final = 4
COMMON: Final[dict[str, Any]] = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
    "max_position_embeddings": 256, "initializer_range": 0.2, "rms_norm_eps": 1e-6,
}
SCALED_ROPE: Final = {"rope_theta": 10000.0, "original_max_position_embeddings": 32}
# 4 experts of 32, 2 chosen per token: with a random router every expert sees some tokens of a
# step and some none, so both the grouping and the skipping of idle experts are exercised.
EXPERTS: Final[dict[str, Any]] = {"num_experts_per_tok": 2, "router_jitter_noise": 0.0}

FAMILY_CONFIGS: Final[dict[str, Callable[[], PretrainedConfig]]] = {
    "llama3": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        **SCALED_ROPE}),
    "llama-yarn": lambda: LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "yarn", "factor": 8.0, **SCALED_ROPE}),
    "qwen2.5": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen2-sliding": lambda: Qwen2Config(**COMMON, use_sliding_window=True,
                                         sliding_window=WINDOW, max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**COMMON, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=WINDOW),
    # Untied: Gemma's sqrt(hidden)-scaled embeddings dominate a random model's residual, and a
    # tied head would then predict the input token forever (identical, but a toothless check).
    "gemma2": lambda: Gemma2Config(
        **COMMON, tie_word_embeddings=False, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": lambda: Gemma3TextConfig(
        **COMMON, tie_word_embeddings=False, query_pre_attn_scalar=24, sliding_window=WINDOW,
        final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "mixtral": lambda: MixtralConfig(**{**COMMON, "intermediate_size": 32}, **EXPERTS,
                                     num_local_experts=4, sliding_window=WINDOW),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse; top-k weights not renormalised.
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, **EXPERTS, num_experts=4,
                                        moe_intermediate_size=32, decoder_sparse_step=1,
                                        mlp_only_layers=[0], norm_topk_prob=False),
    "phi3": lambda: Phi3Config(**{k: v for k, v in COMMON.items() if k != "head_dim"},
                               sliding_window=WINDOW, partial_rotary_factor=0.5,
                               pad_token_id=0),
    # No family module reads these: the generic path (transformers' forward, paged attention).
    "olmo2": lambda: Olmo2Config(**COMMON),
    "granite": lambda: GraniteConfig(**COMMON, embedding_multiplier=2.0, logits_scaling=3.0,
                                     residual_multiplier=0.5, attention_multiplier=0.2),
    "starcoder2": lambda: Starcoder2Config(**COMMON, sliding_window=WINDOW),
    "gpt_neox": lambda: GPTNeoXConfig(**COMMON, rotary_pct=0.5),
    # Experts plus a gated shared expert: no family module, transformers' own MoE forward.
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, **EXPERTS, num_experts=4,
                                        moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48),
}
FAMILIES: Final = tuple(FAMILY_CONFIGS)
GENERIC_FAMILIES: Final = ("olmo2", "granite", "starcoder2", "gpt_neox", "qwen2_moe")

# Ragged prompts: shorter than a window, a few windows long, and one filling many blocks.
PROMPT_LENGTHS: Final = (5, 19, 41, 2)
NEW_TOKENS: Final = 24
# The engine's device in the token-identity check (transformers' reference stays on the CPU):
# bench/gpu.sh sets cuda. fp32 on CUDA matches, as torch leaves TF32 matmuls off by default.
DEVICE: Final = os.environ.get("CLEAVE_TEST_DEVICE", "cpu")


def build_family_model(family: str, directory: Path, seed: int = 0) -> Path:
    """Write a tiny random ``family`` checkpoint plus tokenizer to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(model_max_length=COMMON["max_position_embeddings"])
    tokenizer.save_pretrained(directory)
    config = FAMILY_CONFIGS[family]()
    config.vocab_size = len(tokenizer)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(directory)
    return directory


def family_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


def engine_and_reference(directory: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens from the engine (paged pool, 4-token blocks, 16-token steps forcing
    chunked prefill over earlier context, batched decode) and from transformers' generate."""
    from cleave.runtime.engine.config import EngineConfig
    from cleave.runtime.engine.llm_engine import LLMEngine
    from cleave.runtime.engine.sequence import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(directory), dtype="float32", device=DEVICE,
                                    kv_cache_bytes=1 << 21, block_size=BLOCK_SIZE,
                                    max_num_batched_tokens=16), progress=lambda _: None)
    prompts = family_prompts()
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    reference = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return [r.token_ids for r in results], reference


def count_identical(root: Path, families: tuple[str, ...] = FAMILIES) -> int:
    """How many families the engine runs token for token like transformers (the bench's
    ``families_identical``)."""
    identical = 0
    for family in families:
        ours, theirs = engine_and_reference(build_family_model(family, root / family))
        identical += ours == theirs
    return identical
