"""The router<->worker wire (serving/wire.py): what one end encodes the other decodes to the same
thing, strictly; unknown and mistyped fields are refused naming them; one error format."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cleave.runtime.engine.outputs import RequestOutput
from cleave.runtime.engine.sequence import FinishReason, SamplingParams, TokenLogprob
from cleave.runtime.serving import wire
from cleave.runtime.serving.json_fields import APIError
from cleave.runtime.serving.upstream import _encode
from cleave.runtime.serving.worker import _line


def test_a_generate_request_round_trips_with_the_engine_s_own_parameters() -> None:
    params = SamplingParams(max_tokens=9, temperature=0.5, seed=-3, stop=("\n",),
                            logit_bias=((5, -1.5),), stop_token_ids=(2,), grammar="start: x")
    sent = wire.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=params,
                                first_token=7, earlier_token_ids=[4],
                                kv_load_failure_policy="fail")
    got = wire.GenerateRequest.model_validate_json(sent.model_dump_json())
    assert got == sent and isinstance(got.sampling, SamplingParams)
    assert got.sampling.logit_bias == ((5, -1.5),)  # tuples again, as the engine hashes them


def test_the_router_leaves_defaults_out_so_the_previous_release_reads_it() -> None:
    """A rolling upgrade runs a new router against old workers for minutes: a request that uses
    nothing new must carry nothing new (an old worker refuses unknown fields, ``cache_salt``
    among them), and what it carries still decodes to the same request."""
    plain = wire.GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=3))
    assert json.loads(_encode(plain)) == {"prompt_token_ids": [1, 2],
                                          "sampling": {"max_tokens": 3}}
    salted = wire.GenerateRequest(prompt_token_ids=[1], first_token=4,
                                  sampling=SamplingParams(max_tokens=3, cache_salt="t"))
    assert json.loads(_encode(salted))["sampling"]["cache_salt"] == "t"  # refused by name
    for sent in (plain, salted):
        assert wire.GenerateRequest.model_validate_json(_encode(sent)) == sent


@pytest.mark.parametrize(("body", "named"), [
    ('{"prompt_token_ids": [1], "sampling": {"max_tokn": 3}}', "sampling.max_tokn"),
    ('{"prompt_token_ids": [1], "samplin": {}}', "samplin"),
    ('{"prompt_token_ids": [1], "sampling": {"top_k": 2.5}}', "sampling.top_k"),
    ('{"prompt_token_ids": [1], "sampling": {"ignore_eos": 1}}', "sampling.ignore_eos"),
    ('{"prompt_token_ids": [1, "2"]}', "prompt_token_ids.1"),
    ('{"prompt_token_ids": [1], "kv_load_failure_policy": "retry"}', "kv_load_failure_policy"),
    ('{"prompt_token_ids": [1], "earlier_token_ids": [3]}', "needs first_token"),
    # The engine's own rule, checked as the message arrives (not on the engine thread).
    ('{"prompt_token_ids": [1], "sampling": {"max_tokens": 0}}', "max_tokens must be at least"),
])
def test_the_worker_refuses_what_the_wire_does_not_define(body: str, named: str) -> None:
    with pytest.raises(ValidationError) as refused:
        wire.GenerateRequest.model_validate_json(body)
    assert named in wire.describe(refused.value)


def test_a_prefill_is_not_a_generate() -> None:
    with pytest.raises(ValidationError):  # a prefill has no first token
        wire.PrefillRequest.model_validate_json('{"prompt_token_ids": [1], "first_token": 2}')


def test_one_error_format_both_ways() -> None:
    err = APIError(400, "bad top_k", param="top_k")
    assert wire.ErrorReply.model_validate(err.body()).error == wire.ErrorDetail(
        message="bad top_k", param="top_k")
    assert wire.error_message(b'{"error": {"message": "busy"}}') == "busy"
    assert wire.error_message(b"<html>502</html>") == "rejected by the worker"


def test_token_lines_carry_logprobs_only_when_there_are_some() -> None:
    out = RequestOutput(request_id="r", new_token_ids=[3], new_text="a", finished=True,
                        finish_reason=FinishReason.LENGTH, num_prompt_tokens=4,
                        num_output_tokens=1, num_cached_tokens=2)
    plain = _line(out)
    assert b"logprobs" not in plain
    line = wire.TokenLine.model_validate_json(plain)
    assert (line.token_ids, line.text, line.finish_reason, line.cached_tokens) == (
        [3], "a", "length", 2)
    out.new_logprobs = [TokenLogprob(3, -0.25, ((3, -0.25), (9, -2.0)))]
    [lp] = wire.TokenLine.model_validate_json(_line(out)).logprobs
    assert (lp.token_id, lp.logprob, lp.top) == (3, -0.25, [(3, -0.25), (9, -2.0)])


def test_a_masked_token_s_minus_infinity_crosses_the_wire() -> None:
    """A logprob of -inf (a model whose logits hold -inf) used to be written as null, which
    made the whole line unreadable: the router took the worker for failed."""
    out = RequestOutput(request_id="r", new_token_ids=[3], new_text="a", finished=False,
                        finish_reason=None, num_prompt_tokens=4, num_output_tokens=1,
                        num_cached_tokens=0)
    out.new_logprobs = [TokenLogprob(3, 0.0, ((3, 0.0), (9, float("-inf"))))]
    [lp] = wire.TokenLine.model_validate_json(_line(out)).logprobs
    assert lp.top == [(3, 0.0), (9, float("-inf"))]
