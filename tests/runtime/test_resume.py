"""Resuming a dropped decode: the continuation request, and its lines' cached count."""

from __future__ import annotations

from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.serving.resume import continuation, rebased
from cleave.runtime.serving.wire import GenerateRequest, TokenLine

PAYLOAD = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], first_token=4,
                          sampling=SamplingParams(max_tokens=8), kv_load_failure_policy="fail")


def test_the_continuation_goes_on_from_the_last_token_sent() -> None:
    c = continuation(PAYLOAD, [4, 7, 8, 9])
    assert c.prompt_token_ids == [1, 2, 3] and c.sampling == PAYLOAD.sampling
    assert c.first_token == 9 and c.earlier_token_ids == [4, 7, 8]
    assert c.kv_load_failure_policy == "recompute"  # the sent tokens' KV is nowhere yet
    assert PAYLOAD.first_token == 4 and PAYLOAD.earlier_token_ids == []  # not modified
    # What the worker reads: the same message, through the wire's own encoding.
    assert GenerateRequest.model_validate_json(c.model_dump_json()) == c


def test_lines_keep_the_requests_own_cached_count() -> None:
    line = TokenLine(token_ids=[4], text="x", prompt_tokens=3, completion_tokens=5,
                     cached_tokens=3)
    assert rebased(line, 0) == line.model_copy(update={"cached_tokens": 0})
    assert line.cached_tokens == 3  # a copy
