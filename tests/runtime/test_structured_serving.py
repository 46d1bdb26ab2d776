"""Structured outputs through the whole platform (issue 16 item 3), with the official ``openai``
client: real prefill and decode worker processes, a real redis-server and the router.

The tiny model is random, so whatever it produces is the grammar's doing: a parsed pydantic
object, one of the choices, a regex match. A long prompt seen for the first time is split (the
prefill worker samples the first token under the grammar, the decode worker rebuilds the matcher
from it); the same prompt again is cached and served whole by the decode worker: a seeded request
must come out the same both ways.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field
from serving_stack import Stack, post_raw, start_stack
from test_serving import DECISIONS, _metric

LONG = "the quick brown fox jumps over the lazy dog " * 6  # > 16 tokens: disaggregated
SPLIT = f'{DECISIONS}{{path="disaggregated"'


class Item(BaseModel):
    size: Literal["S", "M", "L"]
    fragile: bool
    name: str = Field(max_length=5)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("structured-logs"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)


def _split_then_whole(stack: Stack, ask: Any) -> list[Any]:
    """``ask(prompt)`` twice on a new long prompt: split the first time, whole the second."""
    assert stack.router is not None
    prompt = f"{time.time_ns()} {LONG}"
    before = _metric(stack.router.url, SPLIT)
    answers = [ask(prompt) for _ in range(2)]
    assert _metric(stack.router.url, SPLIT) == before + 1
    return answers


def test_parse_returns_the_pydantic_object_split_or_whole(stack: Stack,
                                                          client: openai.OpenAI) -> None:
    def ask(prompt: str) -> Any:
        return client.beta.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": prompt}], response_format=Item,
            max_tokens=200, temperature=1.0, seed=7)

    answers = _split_then_whole(stack, ask)
    for got in answers:
        choice = got.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Item)
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_guided_choice_and_regex_on_completions(stack: Stack, client: openai.OpenAI) -> None:
    choices = ["red", "green", "blue sky"]
    for extra, check in (({"guided_choice": choices}, lambda t: t in choices),
                         ({"guided_regex": r"[a-f]{3}-[0-9]{1,3}"},
                          lambda t: re.fullmatch(r"[a-f]{3}-[0-9]{1,3}", t))):
        def ask(prompt: str, extra: dict[str, Any] = extra) -> str:
            got = client.completions.create(model="tiny", prompt=prompt, max_tokens=30,
                                            temperature=1.0, seed=3, extra_body=extra)
            assert got.choices[0].finish_reason == "stop"
            return got.choices[0].text

        texts = _split_then_whole(stack, ask)
        assert texts[0] == texts[1] and check(texts[0]), (extra, texts)


def test_json_object_and_structured_outputs_parse(stack: Stack, client: openai.OpenAI) -> None:
    """An unbounded object: a bias towards quotes and braces lets the random model finish."""
    assert stack.router is not None
    status, tokens = post_raw(stack.router.url + "/tokenize", json.dumps(
        {"prompt": '"}', "add_special_tokens": False}).encode())
    assert status == 200 and isinstance(tokens["tokens"], list) and len(tokens["tokens"]) == 2
    bias = {str(t): 6 for t in tokens["tokens"]}
    for extra in ({"response_format": {"type": "json_object"}},
                  {"structured_outputs": {"json": {"type": "object"}}}):
        got = client.completions.create(model="tiny", prompt=LONG, max_tokens=300, seed=1,
                                        temperature=1.0, logit_bias=bias, extra_body=extra)
        assert got.choices[0].finish_reason == "stop", extra
        assert isinstance(json.loads(got.choices[0].text), dict)


def test_streamed_chat_with_a_schema_parses(client: openai.OpenAI) -> None:
    schema = {"name": "item", "strict": True, "schema": Item.model_json_schema()}
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=200, seed=2,
        temperature=1.0, stream=True,
        response_format={"type": "json_schema", "json_schema": schema})  # type: ignore[arg-type]
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    Item.model_validate_json(text)


@pytest.mark.parametrize("extra, field", [
    ({"guided_regex": "(["}, "guided_regex"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),  # the second named
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
])
def test_a_bad_structured_output_is_a_400_naming_the_field(client: openai.OpenAI,
                                                          extra: dict[str, Any],
                                                          field: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="hi", max_tokens=5, extra_body=extra)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == field
