"""Tensor parallelism on CPU: 2 gloo ranks (rank 0 here, one spawned follower) against one rank,
fp32, on tiny models of several families; and the KV handoff between a TP=2 engine and a TP=1
one, both ways, through the block store (blocks leave and enter the engine in the full
layout)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from family_models import BLOCK_SIZE, build_family_model, family_prompts

from cleave.kv_store.keys import KeySpace
from cleave.kv_store.store import MemoryBlockStore
from cleave.runtime.engine import model_runner
from cleave.runtime.engine.async_engine import AsyncEngine
from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.parallel.shard import TensorParallelError
from cleave.runtime.engine.sequence import SamplingParams, Sequence, TokenLogprob
from cleave.runtime.kv_connector import KVStoreConnector

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _engine(directory: Path, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), dtype="float32", device="cpu",
                                  kv_cache_bytes=1 << 20, block_size=BLOCK_SIZE,
                                  max_num_batched_tokens=16, tensor_parallel_size=tp),
                     progress=lambda _: None)


def _run(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
         ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens, and every step's logits (what the sampler was handed)."""
    seen: list[torch.Tensor] = []
    real = model_runner.sample

    def spy(logits: torch.Tensor, seqs: list[Sequence]
            ) -> tuple[list[int], list[TokenLogprob | None]]:
        seen.append(logits.clone())
        return real(logits, seqs)

    monkeypatch.setattr(model_runner, "sample", spy)
    results = engine.generate(family_prompts(), GREEDY)
    monkeypatch.setattr(model_runner, "sample", real)
    return [r.token_ids for r in results], seen


# q/k/v biases (qwen2.5), Gemma's sandwich norms after the all-reduce and soft-caps (gemma2),
# experts (mixtral): each shards a different way (llama3 runs in the handoff tests below).
@pytest.mark.parametrize("family", ["qwen2.5", "gemma2", "mixtral"])
def test_two_ranks_match_one(family: str, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    directory = build_family_model(family, tmp_path / family)
    want_tokens, want_logits = _run(_engine(directory, 1), monkeypatch)
    tp = _engine(directory, 2)
    try:
        assert tp.pool.k[0].shape[0] == 1  # this rank holds 1 of the 2 KV heads
        got_tokens, got_logits = _run(tp, monkeypatch)
    finally:
        tp.close()
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits)
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert any(len(set(t)) > 3 for t in got_tokens)  # not one repeated token


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_model("llama3", tmp_path_factory.mktemp("tp") / "llama3")


@pytest.fixture(scope="module")
def tp2(llama: Path) -> Iterator[LLMEngine]:
    engine = _engine(llama, 2)
    yield engine
    engine.close()


@pytest.mark.parametrize("direction", ["tp2-to-tp1", "tp1-to-tp2"])
async def test_handoff_through_the_store_between_sizes(direction: str, llama: Path,
                                                       tp2: LLMEngine) -> None:
    tp1 = _engine(llama, 1)
    assert tp1.root_hash == tp2.root_hash  # same blocks in the store, whichever size wrote them
    # Its own prompt per direction: the module's TP=2 engine must not hit its prefix cache.
    first = 5 if direction == "tp2-to-tp1" else 50
    prompt = list(range(first, first + 30))
    [want] = _engine(llama, 1).generate([prompt], GREEDY)
    prefill, decode = ((AsyncEngine(tp2), AsyncEngine(tp1)) if direction == "tp2-to-tp1"
                       else (AsyncEngine(tp1), AsyncEngine(tp2)))
    store = MemoryBlockStore(KeySpace("svc", tp2.root_hash))
    try:
        out = await KVStoreConnector(prefill, store).prefill(prompt, GREEDY)
        assert out.handoff is not None
        assert tuple(out.handoff.blocks[0].shape) == tp1.block_shape  # the full layout
        assert len(store.values) == len(prompt) // BLOCK_SIZE
        before = decode.engine.stats.prompt_tokens_computed
        got = [out.handoff.first_token]
        async for o in KVStoreConnector(decode, store).decode(prompt, GREEDY, got[0]):
            got += o.new_token_ids
        computed = decode.engine.stats.prompt_tokens_computed - before
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert got == want.token_ids
    # the stored blocks were used, not recomputed: only the partial last block was
    assert computed == len(prompt) % BLOCK_SIZE


def test_refusals(llama: Path, tmp_path: Path) -> None:
    with pytest.raises(TensorParallelError, match="does not divide the model's 2 KV heads"):
        _engine(llama, 4)
    starcoder = build_family_model("starcoder2", tmp_path / "starcoder2")
    with pytest.raises(TensorParallelError, match="generic path"):
        _engine(starcoder, 2)
