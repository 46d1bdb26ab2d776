"""The engine against transformers' reference, on a tiny random Llama (fp32, seconds)."""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import hf_greedy

from cleave.runtime.engine.sequence import FinishReason, SamplingParams


def _prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for length in lengths[:n]]


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
LENGTHS = [5, 17, 40, 100, 33, 64, 1]


def test_greedy_matches_transformers_on_ragged_batch(tiny_engine_factory, tiny_hf_model) -> None:
    # A small step budget forces chunked prefill and mixed prefill/decode steps.
    engine = tiny_engine_factory(max_num_batched_tokens=48)
    prompts = _prompts(7, LENGTHS)
    results = engine.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(tiny_hf_model, prompt, 24)
        assert result.finish_reason is FinishReason.LENGTH
    assert engine.stats.prompt_tokens_computed == sum(LENGTHS)
    assert engine.kv_usage_ratio() == 0.0  # everything released


def test_logprobs_match_reference_logits(tiny_engine_factory, tiny_hf_model) -> None:
    engine = tiny_engine_factory()
    prompt = _prompts(1, [30], seed=3)[0]
    [result] = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True,
                                                        logprobs=5))
    full = torch.tensor([prompt + result.token_ids[:-1]])
    with torch.inference_mode():
        ref = torch.log_softmax(tiny_hf_model(full).logits[0, len(prompt) - 1:].float(), -1)
    assert len(result.logprobs) == 6
    for step, lp in enumerate(result.logprobs):
        assert lp.token_id == result.token_ids[step]
        assert lp.logprob == pytest.approx(float(ref[step, lp.token_id]), abs=1e-4)
        top_ids = [t for t, _ in lp.top]
        assert top_ids == ref[step].topk(5).indices.tolist()


def test_prefill_and_decode_in_two_engines_equal_one(tiny_engine_factory) -> None:
    single = tiny_engine_factory()
    prefill = tiny_engine_factory()
    decode = tiny_engine_factory()
    prompts = _prompts(4, [70, 16, 9, 130], seed=5)
    expected = single.generate(prompts, GREEDY)
    for prompt, want in zip(prompts, expected, strict=True):
        [first] = prefill.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
        # generate() on a prefill-only request: run it explicitly.
        prefill.add_request("p", prompt, GREEDY, prefill_only=True)
        outs = []
        while prefill.has_unfinished:
            outs += prefill.step()
        [handoff] = outs
        assert handoff.finish_reason is FinishReason.PREFILL_DONE
        kv = handoff.handoff
        assert kv is not None and len(kv.block_hashes) == len(prompt) // 16
        assert kv.first_token == want.token_ids[0] == first.token_ids[0]
        before = decode.stats.prompt_tokens_computed
        decode.add_request("d", prompt, GREEDY, kv=kv)
        got = [kv.first_token]
        while decode.has_unfinished:
            for o in decode.step():
                got += o.new_token_ids
        assert got == want.token_ids
        # Only the tail past the last full block (and the first token) was computed.
        assert decode.stats.prompt_tokens_computed - before == len(prompt) % 16


def test_tampered_handoff_is_recomputed_not_trusted(tiny_engine_factory) -> None:
    prefill, decode, single = (tiny_engine_factory() for _ in range(3))
    prompt = _prompts(1, [64], seed=9)[0]
    [want] = single.generate([prompt], GREEDY)
    prefill.add_request("p", prompt, GREEDY, prefill_only=True)
    [handoff] = prefill.step()
    kv = handoff.handoff
    assert kv is not None
    forged = type(kv)(block_hashes=[kv.block_hashes[0], b"\0" * 32, *kv.block_hashes[2:]],
                      blocks=kv.blocks, first_token=kv.first_token)
    decode.add_request("d", prompt, GREEDY, kv=forged)
    got = [kv.first_token]
    while decode.has_unfinished:
        for o in decode.step():
            got += o.new_token_ids
    assert got == want.token_ids
    # Block 0 was trusted; blocks 1.. failed verification and were recomputed.
    assert decode.stats.prompt_tokens_computed == len(prompt) - 16


def test_requests_joining_mid_run_match_running_alone(tiny_engine_factory) -> None:
    alone = tiny_engine_factory()
    prompts = _prompts(5, [12, 50, 33, 80, 7], seed=11)
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in prompts]
    engine = tiny_engine_factory(max_num_batched_tokens=40)
    got: dict[str, list[int]] = {}
    engine.add_request("r0", prompts[0], GREEDY)
    pending = list(enumerate(prompts))[1:]
    steps = 0
    while engine.has_unfinished or pending:
        if pending and steps % 3 == 2:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
    assert [got[f"r{i}"] for i in range(5)] == expected


def test_preemption_by_recompute_keeps_outputs_identical(tiny_engine_factory) -> None:
    roomy = tiny_engine_factory()
    prompts = _prompts(6, [30, 45, 20, 60, 25, 40], seed=13)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = [r.token_ids for r in roomy.generate(prompts, params)]
    # 2 layers * 2 * 2 heads * 16 dims * 16 tokens * 4 bytes = 8 KiB a block: 16 blocks.
    tight = tiny_engine_factory(kv_cache_bytes=16 * 8192)
    got = [r.token_ids for r in tight.generate(prompts, params)]
    assert tight.stats.preemptions > 0
    assert got == expected


def test_shared_prefix_is_computed_once(tiny_engine_factory) -> None:
    engine = tiny_engine_factory()
    system = _prompts(1, [64], seed=17)[0]
    a, b = [*system, 5, 6, 7], [*system, 8, 9]
    engine.generate([a], GREEDY)
    before = engine.stats.prompt_tokens_computed
    [rb] = engine.generate([b], GREEDY)
    assert rb.num_cached_tokens == 64
    assert engine.stats.prompt_tokens_computed - before == 2


def test_seeded_sampling_is_reproducible(tiny_engine_factory) -> None:
    engine = tiny_engine_factory()
    prompt = _prompts(1, [20], seed=19)[0]
    sampled = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.95, top_k=50, seed=7,
                             ignore_eos=True)
    first, second = engine.generate([prompt, prompt], sampled)
    other = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=1.0, seed=8,
                                                     ignore_eos=True))[0]
    assert first.token_ids == second.token_ids
    assert other.token_ids != first.token_ids
    top1 = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.8, top_k=1,
                                                    seed=3, ignore_eos=True))[0]
    assert top1.token_ids == engine.generate([prompt], GREEDY.__class__(
        max_tokens=30, ignore_eos=True))[0].token_ids


def test_stop_string_and_eos_end_the_request(tiny_engine_factory) -> None:
    engine = tiny_engine_factory()
    prompt = _prompts(1, [10], seed=23)[0]
    [free] = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free.text[5:8]
    assert stop.strip(), "the tiny model should produce text to cut"
    [cut] = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True,
                                                     stop=(stop,)))
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == free.text[:free.text.index(stop)]
    token = free.token_ids[3]
    [eos] = engine.generate([prompt], SamplingParams(max_tokens=30, stop_token_ids=(token,)))
    assert eos.token_ids == free.token_ids[:free.token_ids.index(token) + 1]
    assert eos.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("budget", [1, 2, 3, 7])
def test_tiny_token_budgets_still_match(tiny_engine_factory, tiny_hf_model, budget: int) -> None:
    # Budgets this small cut prompts into one-token chunks that must not be sampled.
    engine = tiny_engine_factory(max_num_batched_tokens=budget)
    prompts = _prompts(3, [9, 20, 4], seed=29)
    results = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(tiny_hf_model, prompt, 6)
