"""Structured outputs in the engine (issue 16 item 3): the grammar mask, its end, and the
matcher state rebuilt from the tokens so far (what a decode worker and a resumed request do)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from cleave.runtime.engine.grammar import Constraint, mask_words
from cleave.runtime.engine.outputs import KVHandoff
from cleave.runtime.engine.sequence import FinishReason, RequestError, SamplingParams
from cleave.runtime.serving.protocol import parse_completion_request
from cleave.runtime.serving.wire import GenerateRequest

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "size": {"enum": ["S", "M", "L"]}}}
PROMPT = list(range(40, 73))


def _grammar(**fields: object) -> str:
    """The grammar the router makes of these structured-output fields."""
    body = {"model": "m", "prompt": "x", **fields}
    g = parse_completion_request(body, ["m"]).sampling_params(8).grammar
    assert g is not None
    return g


def _run(engine: Any, params: SamplingParams, kv: KVHandoff | None = None,
         prompt: list[int] = PROMPT) -> tuple[list[int], str, FinishReason | None]:
    engine.add_request("r", prompt, params, kv=kv)
    ids: list[int] = []
    text, reason = "", None
    while engine.has_unfinished:
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
            reason = out.finish_reason
    return ids, text, reason


@pytest.fixture(scope="module")
def engine(tiny_engine_factory: Any) -> Any:
    return tiny_engine_factory(num_threads=1)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_json_parses_and_ends_with_the_grammar(engine: Any, seed: int) -> None:
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                            grammar=_grammar(guided_json=SCHEMA))
    ids, text, reason = _run(engine, params)
    assert reason is FinishReason.STOP  # the grammar completed and allowed EOS only then
    assert ids[-1] in engine.eos_token_ids
    value = json.loads(text)
    assert set(value) == {"name", "size"} and value["size"] in "SML"
    assert len(value["name"]) <= 6


def _favoured(engine: Any, chars: str) -> tuple[tuple[int, float], ...]:
    """A bias towards closing quotes and braces: the random model would fill an unbounded
    JSON string up to max_tokens, and a test wants it to finish."""
    return tuple((engine.tokenizer.convert_tokens_to_ids(c), 6.0) for c in chars)


def test_regex_choice_and_json_object(engine: Any) -> None:
    for body, check in (
            ({"guided_regex": r"[a-c]{2}-[0-9]{2}"},
             lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{2}", t)),
            ({"guided_choice": ["yes", "no \"quoted\"", "été"]},
             lambda t: t in ("yes", "no \"quoted\"", "été")),
            ({"response_format": {"type": "json_object"}},
             lambda t: isinstance(json.loads(t), dict)),
            # vLLM's grammars: GBNF (llama.cpp's, xgrammar's) as well as Lark's syntax
            ({"guided_grammar": 'root ::= [a-c] [a-c]? "=" ("0" | "1")'},
             lambda t: re.fullmatch(r"[a-c]{1,2}=[01]", t))):
        for seed in (4, 5):
            params = SamplingParams(max_tokens=300, temperature=1.0, seed=seed,
                                    grammar=_grammar(**body),
                                    logit_bias=_favoured(engine, '"}'))
            _, text, reason = _run(engine, params)
            assert reason is FinishReason.STOP and check(text), (body, text)


def test_the_grammar_wins_over_min_tokens(engine: Any) -> None:
    """min_tokens bans EOS, a complete grammar allows nothing else: the grammar ends it."""
    params = SamplingParams(max_tokens=20, min_tokens=15, grammar=_grammar(guided_choice=["ab"]))
    _, text, reason = _run(engine, params)
    assert (text, reason) == ("ab", FinishReason.STOP)


@pytest.mark.parametrize("k", [1, 4, 9])
def test_a_handed_over_request_goes_on_under_the_same_grammar(
        tiny_engine_factory: Any, k: int) -> None:
    """A decode worker given the first tokens (a prefill worker's, or those a resumed stream
    had sent) rebuilds the matcher from them and samples exactly what one engine would."""
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=11,
                            grammar=_grammar(guided_json=SCHEMA))
    whole, text, _ = _run(tiny_engine_factory(num_threads=1), params)
    assert len(whole) > k
    kv = KVHandoff(block_hashes=[], blocks=[], first_token=whole[k - 1],
                   earlier_tokens=tuple(whole[:k - 1]))
    rest, _, reason = _run(tiny_engine_factory(num_threads=1), params, kv=kv)
    assert whole[:k] + rest == whole and reason is FinishReason.STOP
    json.loads(text)


def _mask(constraint: Constraint, output: list[int], vocab: int) -> torch.Tensor:
    row = torch.zeros(mask_words(vocab), dtype=torch.int32)
    constraint.fill(output, row)
    return row


def test_matcher_state_is_a_function_of_the_tokens(engine: Any) -> None:
    """Stepped token by token, given them all at once, or handed fewer than it has seen: the
    same tokens give the same mask."""
    g = _grammar(guided_json=SCHEMA)
    tokens = engine.tokenizer.encode('{"name":"abc","size":"M"}', add_special_tokens=False)
    vocab = engine.grammars.vocab
    stepped = engine.grammars.constraint(g)
    masks = [_mask(stepped, tokens[:i], vocab) for i in range(len(tokens) + 1)]
    assert len({tuple(m.tolist()) for m in masks}) > 2  # the masks do change along the way
    for i in (0, 3, len(tokens)):
        fresh = engine.grammars.constraint(g)
        assert torch.equal(_mask(fresh, tokens[:i], vocab), masks[i])
        assert torch.equal(_mask(stepped, tokens[:i], vocab), masks[i])  # went back: rebuilt
    assert stepped.accepts(tokens) and not stepped.accepts(tokens[:-1])


def test_tokens_the_grammar_refuses_end_the_request(engine: Any) -> None:
    """A resumed request whose tokens break the grammar (not ones it chose) gets EOS only:
    it ends, the engine goes on."""
    params = SamplingParams(max_tokens=10, grammar=_grammar(guided_regex="[0-9]+"))
    bad = engine.tokenizer.encode("xyz", add_special_tokens=False)
    kv = KVHandoff(block_hashes=[], blocks=[], first_token=bad[-1],
                   earlier_tokens=tuple(bad[:-1]))
    rest, _, reason = _run(engine, params, kv=kv)
    assert reason is FinishReason.STOP and len(rest) == 1 and rest[0] in engine.eos_token_ids


def test_a_plain_row_beside_a_constrained_one_is_unchanged(engine: Any) -> None:
    plain = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    constrained = SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                 grammar=_grammar(guided_regex="[a-z]+"))
    [alone] = engine.generate([PROMPT], plain)
    both = engine.generate([PROMPT, PROMPT], [plain, constrained])
    assert both[0].token_ids == alone.token_ids
    assert re.fullmatch("[a-z]+", both[1].text)


def test_a_grammar_that_does_not_compile_is_refused(engine: Any) -> None:
    with pytest.raises(RequestError, match="grammar"):
        engine.make_sequence("x", PROMPT, SamplingParams(grammar="start: nope"))
    with pytest.raises(RequestError, match="ignore_eos"):
        SamplingParams(grammar=_grammar(guided_regex="a"), ignore_eos=True)


def test_the_grammar_crosses_the_worker_wire() -> None:
    """The router encodes the wire message; the worker reads the grammar back, typed."""
    params = SamplingParams(max_tokens=4, grammar=_grammar(guided_choice=["a", "b"]))
    sent = GenerateRequest(prompt_token_ids=[1], sampling=params).model_dump_json()
    assert GenerateRequest.model_validate_json(sent).sampling == params
    with pytest.raises(ValidationError, match=r"sampling\.grammar"):
        GenerateRequest.model_validate_json(
            '{"prompt_token_ids": [1], "sampling": {"grammar": 5}}')
