"""Decode steps at fixed shapes (engine/dense/graphs.py): the padded batch, padded block tables
and scratch slot give the same logits and tokens as the ordinary path. On the CPU the fixed-shape
forward runs eagerly; with CLEAVE_TEST_DEVICE=cuda (bench/gpu.sh) it is captured and replayed as
CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_models import BLOCK_SIZE, DEVICE, build_family_model, family_prompts

from cleave.runtime.engine import model_runner
from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sequence import SamplingParams, Sequence, TokenLogprob

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def _engine(directory: Path, graphs: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), dtype="float32", device=DEVICE,
                                  kv_cache_bytes=1 << 20, block_size=BLOCK_SIZE,
                                  max_num_batched_tokens=16, decode_graphs=graphs),
                     progress=lambda _: None)


def _run(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
         ) -> tuple[list[list[int]], list[torch.Tensor]]:
    seen: list[torch.Tensor] = []
    real = model_runner.sample

    def spy(logits: torch.Tensor, seqs: list[Sequence]
            ) -> tuple[list[int], list[TokenLogprob | None]]:
        seen.append(logits.cpu().clone())
        return real(logits, seqs)

    monkeypatch.setattr(model_runner, "sample", spy)
    # Ragged prompts (2 to 41 tokens, 4 sequences: padded to a batch bucket of 4, tables of
    # different widths padded to a width bucket) and one odd batch of 3 (a padded row).
    results = engine.generate(family_prompts() + family_prompts(seed=1)[:3], GREEDY)
    monkeypatch.setattr(model_runner, "sample", real)
    return [r.token_ids for r in results], seen


# Plain (llama3), sliding window (mistral), soft-caps and sandwich norms (gemma2).
@pytest.mark.parametrize("family", ["llama3", "mistral", "gemma2"])
def test_fixed_shape_decode_matches_the_ordinary_path(family: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    directory = build_family_model(family, tmp_path / family)
    want_tokens, want_logits = _run(_engine(directory, "off"), monkeypatch)
    engine = _engine(directory, "on")
    assert engine.graphs is not None
    # the pool's last block is the padded rows' scratch, never handed out
    assert engine.block_manager.num_blocks == engine.pool.num_blocks - 1
    got_tokens, got_logits = _run(engine, monkeypatch)
    assert engine.graphs.steps > 10  # the decode steps took the fixed-shape path
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_experts_and_the_cpu_default_keep_the_ordinary_path(tmp_path: Path) -> None:
    mixtral = build_family_model("mixtral", tmp_path / "mixtral")
    assert _engine(mixtral, "on").graphs is None  # per-expert counts are read on the host
    llama = build_family_model("llama3", tmp_path / "llama3")
    if DEVICE == "cpu":
        engine = _engine(llama, "auto")
        assert engine.graphs is None
        assert engine.block_manager.num_blocks == engine.pool.num_blocks
