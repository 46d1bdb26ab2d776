"""The sampler's logit rules (issue 16 item 2): each penalty, logit bias, min-p and min_tokens
against its formula on hand-made logits, and the engine end to end on the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.outputs import KVHandoff
from cleave.runtime.engine.sampler import _filtered, adjust, sample
from cleave.runtime.engine.sequence import RequestError, SamplingParams, Sequence

torch.set_num_threads(1)
VOCAB = 8


def _seq(prompt: list[int], output: list[int], eos: frozenset[int] = frozenset(),
         **params: object) -> Sequence:
    return Sequence("r", [*prompt, *output], len(prompt), SamplingParams(**params),  # type: ignore[arg-type]
                    eos_token_ids=eos)


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, 1.5]])


def test_no_rule_returns_the_same_tensor() -> None:
    """The common decode step pays nothing: no copy, no op."""
    logits = LOGITS.clone()
    assert adjust(logits, [_seq([1], [2], temperature=0.7, top_k=3)]) is logits


def test_frequency_and_presence_penalties_follow_openai() -> None:
    # Output has token 0 twice and token 2 once; the prompt's token 3 does not count.
    seq = _seq([3, 3], [0, 0, 2], frequency_penalty=0.5, presence_penalty=0.25)
    got = adjust(LOGITS.clone(), [seq])[0]
    counts = torch.tensor([2, 0, 1, 0, 0, 0, 0, 0], dtype=torch.float32)
    want = LOGITS[0] - 0.5 * counts - 0.25 * (counts > 0).float()
    assert torch.allclose(got, want)


def test_repetition_penalty_covers_prompt_and_output() -> None:
    seq = _seq([3, 4], [1, 0], repetition_penalty=2.0)
    got = adjust(LOGITS.clone(), [seq])[0]
    want = LOGITS[0].clone()
    for t in (0, 1, 3, 4):  # seen: positive logits divided, negative multiplied
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    assert torch.allclose(got, want)
    assert got[6] == LOGITS[0, 6]  # unseen tokens untouched


def test_logit_bias_adds_and_forces_a_token() -> None:
    seq = _seq([1], [], logit_bias=((4, 100.0), (3, -100.0)))
    got = adjust(LOGITS.clone(), [seq])[0]
    assert got[4] == LOGITS[0, 4] + 100 and got[3] == LOGITS[0, 3] - 100
    tokens, _ = sample(LOGITS.clone(), [seq])
    assert tokens == [4]  # greedy picks the forced token


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    eos = frozenset({3})
    early = _seq([1], [5], eos, min_tokens=3, stop_token_ids=(0,))
    got = adjust(LOGITS.clone(), [early])[0]
    assert got[3] == -math.inf and got[0] == -math.inf
    assert sample(LOGITS.clone(), [early])[0] == [7]  # the best of the rest
    reached = _seq([1], [5, 6, 7], eos, min_tokens=3, stop_token_ids=(0,))
    assert sample(LOGITS.clone(), [reached])[0] == [3]


def test_rules_apply_per_row_only() -> None:
    """A batch mixing a penalized row and a plain one: the plain row is untouched."""
    logits = torch.cat([LOGITS, LOGITS])
    seqs = [_seq([1], [], logit_bias=((4, 50.0),)), _seq([1], [])]
    got = adjust(logits.clone(), seqs)
    assert got[0, 4] == LOGITS[0, 4] + 50 and torch.equal(got[1], LOGITS[0])
    assert sample(logits.clone(), seqs)[0] == [4, 3]


def test_batched_penalties_equal_each_row_alone() -> None:
    """Rows with their own penalties and tokens, in one batch, with a plain row between:
    each row comes out as it would alone."""
    seqs = [_seq([3, 4], [0, 0, 7], frequency_penalty=0.7, repetition_penalty=1.5),
            _seq([1], [2]),
            _seq([5], [5, 6, 6, 6], presence_penalty=-1.0, frequency_penalty=0.1,
                 logit_bias=((1, -2.0),))]
    batch = adjust(torch.cat([LOGITS] * 3), seqs)
    for row, seq in enumerate(seqs):
        assert torch.allclose(batch[row], adjust(LOGITS.clone(), [seq])[0]), row


def test_min_p_keeps_tokens_at_least_min_p_of_the_top() -> None:
    probs = LOGITS[0].softmax(-1)
    kept = _filtered(LOGITS[0], 1.0, 0, 1.0, min_p=0.3).isfinite()
    assert torch.equal(kept, probs >= 0.3 * probs.max())
    assert 1 < int(kept.sum()) < VOCAB


def test_seeded_sampling_with_rules_is_reproducible() -> None:
    def draw() -> list[int]:
        seq = _seq([1, 2], [0, 0], temperature=1.0, seed=7, frequency_penalty=1.0,
                   min_p=0.05)
        return [sample(LOGITS.clone(), [seq])[0][0] for _ in range(3)]

    assert draw() == draw()


@pytest.mark.parametrize("params", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0.0},
    {"min_p": 1.5}, {"min_tokens": 5, "max_tokens": 4}, {"logit_bias": ((1, 101.0),)},
    {"logit_bias": ((-1, 1.0),)}, {"stop_token_ids": (-1,)}, {"presence_penalty": math.nan},
])
def test_out_of_range_parameters_are_refused(params: dict[str, object]) -> None:
    with pytest.raises(RequestError):
        SamplingParams(**params)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                  kv_cache_bytes=1 << 23, num_threads=1),
                     progress=lambda _: None)


PROMPT = "the quick brown fox jumps over the lazy dog"


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_engine_frequency_penalty_reduces_repeats(engine: LLMEngine) -> None:
    plain, penalized = engine.generate(
        [PROMPT, PROMPT], [SamplingParams(max_tokens=24, ignore_eos=True),
                           SamplingParams(max_tokens=24, ignore_eos=True,
                                          frequency_penalty=2.0, presence_penalty=2.0)])
    assert _repeats(penalized.token_ids) < _repeats(plain.token_ids)


def test_engine_logit_bias_and_token_id_checks(engine: LLMEngine) -> None:
    [forced] = engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True,
                                                        logit_bias=((5, 100.0),)))
    assert forced.token_ids == [5, 5, 5, 5]
    vocab = engine.shape.vocab_size
    with pytest.raises(RequestError, match="logit_bias"):
        engine.add_request("x", PROMPT, SamplingParams(logit_bias=((vocab, 1.0),)))


def test_engine_stop_token_ids_and_min_tokens(engine: LLMEngine) -> None:
    [free] = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))
    stop = free.token_ids[2]
    [stopped] = engine.generate([PROMPT], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
    assert stopped.token_ids[-1] == stop and len(stopped.token_ids) <= 3
    [held] = engine.generate([PROMPT], SamplingParams(max_tokens=8, stop_token_ids=(stop,),
                                                      min_tokens=6))
    assert len(held.token_ids) >= 6 and stop not in held.token_ids[:6]


def test_penalties_go_on_exactly_after_a_handoff(engine: LLMEngine) -> None:
    """A decode worker (or a resumed decode) holds the earlier output as handed-over tokens:
    the penalties' counts and min_tokens read them, so the rest is the uninterrupted answer."""
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=11, frequency_penalty=1.5,
                            presence_penalty=0.5, repetition_penalty=1.3, min_tokens=12,
                            logit_bias=((7, 3.0),))
    [whole] = engine.generate([PROMPT], params)
    for k in (1, 5, 11):
        sent = whole.token_ids[:k]
        kv = KVHandoff(block_hashes=[], blocks=[], first_token=sent[-1],
                       earlier_tokens=tuple(sent[:-1]))
        engine.add_request(f"resume-{k}", PROMPT, params, kv=kv)
        rest: list[int] = []
        while engine.has_unfinished:
            for out in engine.step():
                rest += out.new_token_ids
        assert sent + rest == whole.token_ids, k
