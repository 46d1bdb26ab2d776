"""Prompt logprobs in the engine (vLLM's ``prompt_logprobs``), against transformers' own
log_softmax over the prompt on the tiny model: chunked prefill accumulates them, a cached
prefix is not read for them, a prefill-only engine computes them and a decode engine handed its
first token does not, and a step nobody asks them of computes the logits it did before."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from cleave.runtime.engine import sampler
from cleave.runtime.engine.outputs import RequestOutput
from cleave.runtime.engine.sequence import SamplingParams, Sequence, TokenLogprob

TOP = 3


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def _reference(model: Any, prompt: list[int]) -> torch.Tensor:
    """Row p: transformers' log-distribution after prompt[:p + 1], fp32."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


def _check(got: list[TokenLogprob] | None, prompt: list[int], ref: torch.Tensor) -> None:
    assert got is not None and len(got) == len(prompt) - 1  # the first token has none
    for p, lp in enumerate(got):
        row, token = ref[p], prompt[p + 1]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert lp.rank == int((row > row[token]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(TOP).indices.tolist()
        assert [x for _, x in lp.top] == pytest.approx(row.topk(TOP).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [512, 7])  # 7: the prompt is prefilled in 7-token chunks
def test_prompt_logprobs_match_transformers(tiny_engine_factory, tiny_hf_model,
                                            budget: int) -> None:
    engine = tiny_engine_factory(max_num_batched_tokens=budget)
    prompt = _prompt(40, seed=1)
    # Next to a request that does not ask: each row goes to its own sequence.
    plain, asked = engine.generate([_prompt(20, seed=2), prompt], [
        SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, prompt_logprobs=TOP)])
    _check(asked.prompt_logprobs, prompt, _reference(tiny_hf_model, prompt))
    assert plain.prompt_logprobs is None
    [alone] = engine.generate([prompt], SamplingParams(max_tokens=4))
    assert asked.token_ids == alone.token_ids  # the extra rows change nothing sampled


def test_a_cached_prefix_is_not_read_for_them(tiny_engine_factory, tiny_hf_model) -> None:
    engine = tiny_engine_factory()
    prompt = _prompt(50, seed=3)
    params = SamplingParams(max_tokens=2, prompt_logprobs=TOP)
    engine.generate([prompt], SamplingParams(max_tokens=2))  # its blocks are now cached
    queried = engine.block_manager.prefix_queried_tokens
    computed = engine.stats.prompt_tokens_computed
    [again] = engine.generate([prompt], params)
    assert again.num_cached_tokens == 0
    assert engine.stats.prompt_tokens_computed - computed == len(prompt)
    assert engine.block_manager.prefix_queried_tokens == queried  # not looked up
    _check(again.prompt_logprobs, prompt, _reference(tiny_hf_model, prompt))
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=2))
    assert plain.num_cached_tokens == 48  # a request that does not ask still reads it


def test_prefill_engine_scores_and_decode_engine_does_not(tiny_engine_factory,
                                                          tiny_hf_model) -> None:
    prefill, decode = tiny_engine_factory(), tiny_engine_factory()
    prompt = _prompt(37, seed=4)
    params = SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=TOP)
    prefill.add_request("p", prompt, params, prefill_only=True)
    [out] = prefill.step()
    assert out.handoff is not None and out.handoff.first_token is not None
    _check(out.prompt_logprobs, prompt, _reference(tiny_hf_model, prompt))
    decode.add_request("d", prompt, params, kv=out.handoff)  # the same params, as sent
    outs: list[RequestOutput] = []
    while decode.has_unfinished:
        outs += decode.step()
    assert all(o.prompt_logprobs is None for o in outs)
    # The handed blocks were used: only the partial block and the first token were computed.
    assert decode.stats.prompt_tokens_computed == len(prompt) % 16


def test_a_one_token_prompt_has_nothing_to_score(tiny_engine_factory) -> None:
    [result] = tiny_engine_factory().generate([[7]], SamplingParams(max_tokens=2,
                                                                     prompt_logprobs=1))
    assert result.prompt_logprobs == []


def test_steps_nobody_asks_of_compute_only_the_sampled_rows(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(max_num_batched_tokens=16)
    rows: list[int] = []
    forward = engine.runner.model.forward

    def counting(input_ids: torch.Tensor, batch: Any, k: Any, v: Any) -> torch.Tensor:
        logits: torch.Tensor = forward(input_ids, batch, k, v)
        rows.append(logits.shape[0])
        return logits

    engine.runner.model.forward = counting  # type: ignore[method-assign]
    engine.generate([_prompt(30, seed=5)], SamplingParams(max_tokens=3))
    assert rows == [0, 1, 1, 1]  # two prefill chunks (one samples), then two decodes
    rows.clear()
    engine.generate([_prompt(30, seed=6)], SamplingParams(max_tokens=3, prompt_logprobs=0))
    assert rows == [16, 14, 1, 1]  # positions 0..28 score tokens 1..29; then the sample


def test_a_recomputed_chunk_scores_nothing_twice() -> None:
    seq = Sequence("r", list(range(10)), 10, SamplingParams(prompt_logprobs=0))
    seq.prompt_logprobs = []
    assert seq.prompt_positions(0, 4) == range(0, 4)
    seq.prompt_logprobs += [TokenLogprob(t, 0.0) for t in range(1, 5)]
    assert seq.prompt_positions(0, 10) == range(4, 9)  # position 9 scores no prompt token
    assert seq.scores_prompt
    seq.prompt_logprobs += [TokenLogprob(t, 0.0) for t in range(5, 10)]
    assert not seq.scores_prompt and seq.prompt_positions(0, 10) == range(0)


def _recording_log_softmax(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every batched log_softmax (a sampled token's is one row, 1-D)."""
    rows: list[int] = []
    log_softmax = torch.log_softmax

    def recording(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows.append(x.shape[0] if x.dim() == 2 else 1)
        return log_softmax(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", recording)
    return rows


def test_scoring_in_slices_gives_what_scoring_at_once_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(10, 64, generator=torch.Generator().manual_seed(0)) * 4
    targets = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = sampler.prompt_logprobs(logits, targets, TOP)
    rows = _recording_log_softmax(monkeypatch)
    monkeypatch.setattr(sampler, "SCORE_ROWS", 3, raising=False)
    sliced = sampler.prompt_logprobs(logits, targets, TOP)
    assert rows == [3, 3, 3, 1]
    assert [(s.token_id, s.rank, [t for t, _ in s.top]) for s in sliced] == \
        [(w.token_id, w.rank, [t for t, _ in w.top]) for w in whole]
    for s, w in zip(sliced, whole, strict=True):
        assert s.logprob == pytest.approx(w.logprob, abs=1e-6)
        assert [x for _, x in s.top] == pytest.approx([x for _, x in w.top], abs=1e-6)


def test_a_long_chunk_is_scored_a_bounded_number_of_rows_at_a_time(
        tiny_engine_factory, tiny_hf_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a chunk's every scored row went through one log_softmax (and one comparison for
    the ranks): [chunk tokens, vocabulary] each, on top of the logits."""
    engine = tiny_engine_factory(max_num_batched_tokens=64)
    rows = _recording_log_softmax(monkeypatch)
    monkeypatch.setattr(sampler, "SCORE_ROWS", 8, raising=False)
    prompt = _prompt(60, seed=7)
    [out] = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=TOP))
    assert sum(rows) >= len(prompt) - 1 and max(rows) == 8, rows  # every row, 8 at most
    _check(out.prompt_logprobs, prompt, _reference(tiny_hf_model, prompt))
