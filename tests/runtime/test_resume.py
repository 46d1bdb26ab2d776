"""Resuming a dropped decode: the continuation request and its lines in the request's terms."""

from __future__ import annotations

from cleave.runtime.serving.resume import continuation, rebased

PAYLOAD = {"request_id": "r", "prompt_token_ids": [1, 2, 3], "first_token": None,
           "sampling": {"max_tokens": 8, "temperature": 0.0}, "kv_load_failure_policy": "fail"}


def test_the_continuation_goes_on_from_the_last_token_sent() -> None:
    c = continuation(PAYLOAD, [1, 2, 3], [7, 8, 9], 8)
    assert c["prompt_token_ids"] == [1, 2, 3, 7, 8] and c["first_token"] == 9
    # The first token counts as one output, so 3 sent leave 5 to go: 8 - 3 + 1 in its terms.
    assert c["sampling"] == {"max_tokens": 6, "temperature": 0.0}
    assert c["kv_load_failure_policy"] == "recompute"  # the sent tokens' KV is nowhere yet
    assert PAYLOAD["prompt_token_ids"] == [1, 2, 3]  # the original is left as it was


def test_a_drop_after_the_last_token_leaves_one_to_finish_at_once() -> None:
    c = continuation(PAYLOAD, [1, 2, 3], list(range(10, 18)), 8)
    assert c["sampling"]["max_tokens"] == 1 and c["first_token"] == 17


def test_lines_are_told_in_the_requests_terms() -> None:
    line = {"token_ids": [4], "text": "x", "finished": True, "prompt_tokens": 5,
            "completion_tokens": 3, "cached_tokens": 5}
    out = rebased(line, prompt_len=3, sent=3)
    assert (out["prompt_tokens"], out["completion_tokens"], out["cached_tokens"]) == (3, 5, 3)
    assert out["text"] == "x" and line["prompt_tokens"] == 5  # a copy
    assert rebased({"token_ids": [4]}, 3, 3) == {"token_ids": [4]}
