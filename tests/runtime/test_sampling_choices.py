"""n and best_of's pure parts (serving/choices.py) and the multi-choice response shapes, checked
with the official ``openai`` client's own models."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.serving import choices, responses
from cleave.runtime.serving.wire import TokenLine


def test_children_are_seeded_seed_plus_index_within_int64() -> None:
    p = SamplingParams(seed=7, temperature=1.0)
    assert [choices.child_params(p, i, False).seed for i in range(3)] == [7, 8, 9]
    top = SamplingParams(seed=(1 << 63) - 1)
    assert choices.child_params(top, 1, False).seed == -(1 << 63)  # wraps, stays int64
    assert choices.child_params(SamplingParams(), 2, False).seed is None  # each its own draw
    assert choices.child_params(p, 0, True).logprobs == 0  # ranking needs them
    assert choices.child_params(SamplingParams(logprobs=3), 0, True).logprobs == 3


def test_best_ranks_by_cumulative_logprob() -> None:
    def seq(*lps: float) -> list[TokenLine]:
        return [TokenLine.model_validate(
            {"logprobs": [{"token_id": 1, "logprob": x} for x in lps]})]

    a, b, c = seq(-1.0, -2.5), seq(-0.5, -0.5), seq(-3.0)
    assert choices.best([a, b, c], 2) == [b, c]
    first, second = seq(-1.0), seq(-1.0)
    assert choices.best([first, second], 1)[0] is first  # a tie: the lower index


async def _lines(index: int, log: list[str], fail_at: int | None = None
                 ) -> AsyncGenerator[dict[str, Any], None]:
    try:
        for k in range(3):
            log.append(f"{index}:{k}")
            if index == fail_at and k == 1:
                raise RuntimeError("worker failed")
            yield {"i": index, "k": k}
            await asyncio.sleep(0)
    finally:
        log.append(f"{index}:closed")


def test_merged_starts_the_others_after_the_first_line() -> None:
    log: list[str] = []

    async def run() -> list[tuple[int, dict[str, Any]]]:
        return [x async for x in choices.merged(lambda i: _lines(i, log), 3)]

    got = asyncio.run(run())
    assert sorted((i, line["k"]) for i, line in got) == [(i, k) for i in range(3)
                                                         for k in range(3)]
    assert log.index("1:0") > log.index("0:0") and log.index("2:0") > log.index("0:0")
    for i in range(3):  # each choice's lines in order
        assert [line["k"] for j, line in got if j == i] == [0, 1, 2]


def test_merged_raises_the_first_failure_and_stops_the_rest() -> None:
    log: list[str] = []

    async def run() -> None:
        async for _ in choices.merged(lambda i: _lines(i, log, fail_at=1), 3):
            await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="worker failed"):
        asyncio.run(run())
    assert all(f"{i}:closed" in log for i in range(3))  # nothing left running


def _line(text: str, finished: bool = False, tokens: int = 1) -> TokenLine:
    return TokenLine.model_validate({"text": text, "token_ids": [1], "finished": finished,
            "finish_reason": "length" if finished else None, "prompt_tokens": 5,
            "completion_tokens": tokens, "cached_tokens": 0})


def test_final_response_with_choices_and_echo() -> None:
    body = responses.final_response("cmpl-1", "m", False,
                                    [[_line("a"), _line("b", True, 2)], [_line("c", True, 1)]],
                                    str, False, echo="P ")
    parsed = Completion.model_validate_json(body.model_dump_json())
    assert [(c.index, c.text) for c in parsed.choices] == [(0, "P ab"), (1, "P c")]
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (5, 3)
    chat = ChatCompletion.model_validate_json(responses.final_response(
        "chatcmpl-1", "m", True, [[_line("x", True)], [_line("y", True)]], str,
        False).model_dump_json())
    assert [c.message.content for c in chat.choices] == ["x", "y"]


def test_stream_writer_tags_each_choice_and_sums_usage_at_the_end() -> None:
    writer = responses.StreamWriter("c", "m", True, True, str, False, choices=2)
    frames = [*writer.chunks(_line("a"), 0), *writer.chunks(_line("b"), 1),
              *writer.chunks(_line("c", True, 2), 1), *writer.chunks(_line("d", True, 2), 0)]
    chunks = [ChatCompletionChunk.model_validate(json.loads(f[len(b"data: "):])) for f in frames]
    texts = ["", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts == ["ad", "bc"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert sum(1 for c in chunks if c.usage is not None) == 1  # once, after both finished
