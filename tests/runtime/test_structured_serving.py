"""Structured outputs through the whole platform (issue 16 item 3), with the official ``openai``
client: real prefill and decode worker processes, a real redis-server and the router; and on the
same stack, vLLM's chat ``echo`` and every kind of response the router sends, each held to the
OpenAPI document and the client's types (response_support.py).

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
from response_support import CHECKED, checked_client, checked_get, checked_post
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
    return checked_client(stack.base_url)  # every response held to the schema


def _split_then_whole(stack: Stack, ask: Any) -> list[Any]:
    """``ask(prompt)`` twice on a new long prompt: split the first time, whole the second."""
    assert stack.router is not None
    prompt = f"{time.time_ns()} {LONG}"
    before = _metric(stack.router.url, SPLIT)
    answers = [ask(prompt) for _ in range(2)]
    assert _metric(stack.router.url, SPLIT) == before + 1
    return answers


def _completions_split_then_whole(stack: Stack, client: openai.OpenAI, extra: dict[str, Any],
                                  max_tokens: int, seed: int) -> list[str]:
    """A seeded completion under ``extra``'s constraint, split then whole: both texts (each
    finished by the constraint, not cut at ``max_tokens``)."""
    def ask(prompt: str) -> str:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                        temperature=1.0, seed=seed, extra_body=extra)
        assert got.choices[0].finish_reason == "stop"
        return got.choices[0].text

    return _split_then_whole(stack, ask)


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
        texts = _completions_split_then_whole(stack, client, extra, max_tokens=30, seed=3)
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
    ({"guided_grammar": "start: nope"}, "guided_grammar"),  # Lark: an unknown rule
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),  # GBNF that does not parse
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": None}}, "structured_outputs"),
])
def test_a_bad_structured_output_is_a_400_naming_the_field(client: openai.OpenAI,
                                                          extra: dict[str, Any],
                                                          field: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="hi", max_tokens=5, extra_body=extra)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == field
    assert field in error["message"]


def test_guided_grammar_lark_and_gbnf(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's grammars, in Lark's syntax and in GBNF, on both endpoints; split and whole."""
    pattern = r"(yes|no)-[a-c]{1,3}"
    for extra in ({"guided_grammar": 'start: ("yes" | "no") "-" /[a-c]{1,3}/'},
                  {"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "-" [a-c] '
                                                     '[a-c]? [a-c]?'}}):
        texts = _completions_split_then_whole(stack, client, extra, max_tokens=20, seed=5)
        assert texts[0] == texts[1] and re.fullmatch(pattern, texts[0]), (extra, texts)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
            temperature=1.0, seed=6, stream=True, extra_body=extra)
        text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        assert re.fullmatch(pattern, text), (extra, text)


def test_chat_echo_starts_with_the_assistant_s_last_message(client: openai.OpenAI) -> None:
    """vLLM's echo: the last message's content, when it is the assistant's, in front of each
    choice's (not counted as completion tokens); any other last message: nothing."""
    start = [{"type": "text", "text": "The answer"}, {"type": "text", "text": "is"}]
    messages: Any = [{"role": "user", "content": "Question?"},
                     {"role": "assistant", "content": start}]
    asked: Any = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(**asked)
    echoed = client.chat.completions.create(**asked, n=2, extra_body={"echo": True})
    answer = plain.choices[0].message.content
    assert answer  # the greedy continuation, without echo
    assert [c.message.content for c in echoed.choices] == ["The answer\nis" + answer] * 2
    assert echoed.usage is not None and plain.usage is not None
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens
    chunks = list(client.chat.completions.create(**asked, n=2, stream=True,
                                                 extra_body={"echo": True}))
    for index in (0, 1):
        deltas = [c.choices[0].delta.content or "" for c in chunks
                  if c.choices and c.choices[0].index == index]
        assert "".join(deltas) == "The answer\nis" + answer
    user_last = {**asked, "messages": messages[:1]}
    assert (client.chat.completions.create(**user_last, extra_body={"echo": True})
            .choices[0].message.content
            == client.chat.completions.create(**user_last).choices[0].message.content)


def test_every_kind_of_response_matches_the_document(stack: Stack,
                                                     client: openai.OpenAI) -> None:
    """One of each body the router sends (options that change the shape: n, logprobs, usage
    chunks, echo, best_of), through the checked client and checked calls: each matched its
    schema and the client's types as it arrived."""
    assert stack.router is not None
    url = stack.router.url
    before = CHECKED.copy()
    common: Any = {"model": "tiny", "max_tokens": 4, "temperature": 1.0, "seed": 1}
    chat: Any = {**common, "messages": [{"role": "user", "content": "hi"}]}
    client.completions.create(**common, prompt="hi", n=2, logprobs=2)
    client.completions.create(**common, prompt="hi", echo=True, best_of=3)
    list(client.completions.create(**common, prompt="hi", n=2, logprobs=2, stream=True,
                                   stream_options={"include_usage": True}))
    client.chat.completions.create(**chat, n=2, logprobs=True, top_logprobs=2)
    list(client.chat.completions.create(**chat, n=2, logprobs=True, top_logprobs=2,
                                        stream=True, stream_options={"include_usage": True}))
    list(client.models.list())
    with pytest.raises(openai.NotFoundError):
        client.completions.create(**{**common, "model": "nope"}, prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**chat, n=0)
    tokens = checked_post(url + "/tokenize", b'{"prompt": "hi"}')[1]["tokens"]
    checked_post(url + "/tokenize", json.dumps({"messages": chat["messages"]}).encode())
    assert checked_post(url + "/detokenize", json.dumps({"tokens": tokens}).encode())[0] == 200
    assert checked_post(url + "/detokenize", b'{"tokens": [-1]}')[0] == 400
    for path in ("/version", "/health", "/ready"):
        assert checked_get(url + path)[0] == 200
    json_ok, stream_ok = "200 application/json", "200 text/event-stream"
    assert set(CHECKED - before) == {
        f"/v1/completions {json_ok}", f"/v1/completions {stream_ok}",
        f"/v1/chat/completions {json_ok}", f"/v1/chat/completions {stream_ok}",
        f"/v1/models {json_ok}", "/v1/completions 404 application/json",
        "/v1/chat/completions 400 application/json", f"/tokenize {json_ok}",
        f"/detokenize {json_ok}", "/detokenize 400 application/json", f"/version {json_ok}",
        f"/health {json_ok}", f"/ready {json_ok}"}
