"""Tool-call parsers (serving/tool_parsers.py) and the request side (serving/tools.py): each
format whole, streamed in every split, malformed calls as plain text, named and required calls
(their openings and grammars), and the request fields' 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cleave.common.settings import TOOL_CALL_PARSERS
from cleave.runtime.serving import protocol as api
from cleave.runtime.serving import tools
from cleave.runtime.serving.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    PARSERS,
    ToolCallStream,
    collect,
    forced_prefix,
)
from cleave.runtime.serving.wire import TokenLine

HERMES_TWO = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Paris <b>", "n": [1, {"x": "}"}]}}\n</tool_call>\n<tool_call>{"name": "now", '
              '"arguments": {}}</tool_call>')
LLAMA_TWO = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "now", "parameters": {}}')
WANT = [("get_weather", {"city": "Paris <b>", "n": [1, {"x": "}"}]}), ("now", {})]


def _run(parser: str, pieces: list[str], **kw: Any) -> tuple[str, list[tuple[str, Any]]]:
    stream = ToolCallStream(parser, **kw)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    content, calls = collect(events)
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def _splits(text: str) -> list[list[str]]:
    """The text whole, char by char, and cut at every point in two."""
    return [[text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))]


def test_hermes_complete_and_streamed_in_any_split() -> None:
    for pieces in _splits(HERMES_TWO):
        content, calls = _run(HERMES, pieces)
        assert content == "Let me check.\n"
        assert calls == WANT


def test_llama3_complete_and_streamed_in_any_split() -> None:
    for pieces in _splits(LLAMA_TWO):
        assert _run(LLAMA3_JSON, pieces) == ("", [("get_weather", {"city": "Paris"}),
                                                  ("now", {})])
    assert _run(LLAMA3_JSON, ['  {"name": "f", "arguments": {"a": 1}}']) == ("", [("f",
                                                                                {"a": 1})])


def test_text_streams_at_once_and_tags_are_held_only_while_they_may_be_one() -> None:
    stream = ToolCallStream(HERMES)
    assert stream.feed("Hello <tool") == ["Hello "]  # "<tool" may open a call: held
    assert stream.feed("box> and") == ["<toolbox> and"]  # it did not
    llama = ToolCallStream(LLAMA3_JSON)
    assert llama.feed("  ") == [] and llama.feed("Sure") == ["  Sure"]
    assert llama.feed(" {x}") == [" {x}"]  # not at the start: text


@pytest.mark.parametrize(("parser", "text"), [
    (HERMES, 'a<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>b'),  # bad JSON
    (HERMES, 'a<tool_call>{"arguments": {}}</tool_call>b'),  # no name
    (HERMES, 'a<tool_call>{"name": "f", "arguments": [1]}</tool_call>b'),  # not an object
    (HERMES, 'a<tool_call>{"name": "f", "argu'),  # cut short (max_tokens)
    (LLAMA3_JSON, '{"name": "f", "parameters": {"x": 1}'),
    (LLAMA3_JSON, '{"name": "f", "parameters": {}} and then some text'),
    (LLAMA3_JSON, '<|python_tag|>print(1)'),
])
def test_malformed_calls_are_plain_text(parser: str, text: str) -> None:
    for pieces in _splits(text):
        assert _run(parser, pieces) == (text, [])


def test_an_unclosed_last_hermes_call_is_still_a_call() -> None:
    """Qwen sometimes ends with EOS before the closing tag."""
    assert _run(HERMES, ['<tool_call>\n{"name": "f", "arguments": {"a": "b"}}\n']) == (
        "", [("f", {"a": "b"})])


def test_parallel_false_keeps_the_first_call() -> None:
    assert _run(HERMES, [HERMES_TWO], single=True)[1] == WANT[:1]


def test_streamed_pieces_carry_index_id_and_name_first() -> None:
    stream = ToolCallStream(HERMES)
    events = stream.feed(HERMES_TWO) + stream.finish()
    deltas = [e for e in events if not isinstance(e, str)]
    assert [(d.index, d.name is not None, d.id is not None) for d in deltas] == [
        (0, True, True), (0, False, False), (1, True, True), (1, False, False)]
    assert stream.has_calls


@pytest.mark.parametrize("parser", PARSERS)
def test_named_call_ends_when_its_arguments_close(parser: str) -> None:
    prefix = forced_prefix(parser, "get_weather")
    assert prefix.endswith(": ") and '"get_weather"' in prefix
    for pieces in _splits('{"city": "a}\\"b", "l": [{}]} and junk'):
        stream = ToolCallStream(parser, forced="get_weather")
        events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
        assert stream.done
        assert collect(events)[1][0].arguments == '{"city": "a}\\"b", "l": [{}]}'
    cut = ToolCallStream(parser, forced="f")  # max_tokens before the end: as written
    assert collect(cut.feed('{"a": 1') + cut.finish())[1][0].arguments == '{"a": 1'


def test_parser_is_chosen_from_the_template() -> None:
    assert tools.resolve_parser("auto", "{{ '<tool_call>' }}") == HERMES
    assert tools.resolve_parser("auto", "{{ '<|python_tag|>' }}") == LLAMA3_JSON
    assert tools.resolve_parser("auto", "{{ messages }}") is None
    assert tools.resolve_parser("none", "<tool_call>") is None
    assert tools.resolve_parser(HERMES, None) == HERMES
    assert set(TOOL_CALL_PARSERS) == {"auto", "none", *PARSERS}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_G = {"type": "function", "function": {"name": "g"}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
     "tools[0].function.strict", "'required' or a named"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "not in 'tools'"),
    ({"tools": [TOOL, TOOL]}, "tools", "twice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "not in"),
])
def test_bad_tool_requests_are_a_400(fields: dict[str, Any], param: str,
                                            words: str) -> None:
    with pytest.raises(api.APIError) as e:
        api.parse_chat_request({**CHAT, **fields}, ["m"])
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message


def test_tool_choices() -> None:
    def choice(**fields: Any) -> tools.ToolRequest | None:
        return api.parse_chat_request({**CHAT, **fields}, ["m"]).tool_request

    auto = choice(tools=[TOOL, TOOL_G])
    assert auto is not None and (auto.choice, auto.name, auto.parallel) == ("auto", None, True)
    assert choice(tools=[TOOL], tool_choice="required") == tools.ToolRequest(
        auto.tools[:1], "function", "f")
    none = choice(tools=[TOOL], tool_choice="none")
    assert none is not None and tools.plan(none, HERMES) is None
    assert choice(tool_choice="none", tools=[]) is None
    with pytest.raises(api.APIError, match="--tool-call-parser"):
        tools.plan(auto, None)  # the model's template has no format Cleave parses
    plan = tools.plan(choice(tools=[TOOL], parallel_tool_calls=False), HERMES)
    assert plan == tools.ToolPlan(HERMES, None, True)


def test_round_trip_messages_reach_the_template_as_objects() -> None:
    messages = [{"role": "user", "content": "w?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "22 C", "tool_call_id": "c1"}]
    req = api.parse_chat_request({**CHAT, "messages": messages}, ["m"])
    assert req.template_messages()[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "22 C", "tool_call_id": "c1"}]


def _lines(text: str, size: int) -> list[TokenLine]:
    """A worker's NDJSON lines carrying ``text`` in pieces of ``size`` characters."""
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    return [TokenLine(text=p, token_ids=[1], finished=i == len(pieces) - 1,
                      finish_reason="stop" if i == len(pieces) - 1 else None, prompt_tokens=5,
                      completion_tokens=i + 1) for i, p in enumerate(pieces)]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_responses_whole_and_streamed_agree_in_openai_s_shapes(size: int) -> None:
    """The worker's lines through the router's response builders, read back with the openai
    client's own models."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from cleave.runtime.serving import responses

    plan = tools.ToolPlan(HERMES, None, False)
    lines = _lines(HERMES_TWO, size)
    whole = ChatCompletion.model_validate_json(responses.final_response(
        "chatcmpl-1", "m", True, [lines], str, False, tools=plan.stream).model_dump_json())
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == WANT
    writer = responses.StreamWriter("chatcmpl-1", "m", True, False, str, False,
                                    tools=plan.stream)
    chunks = [ChatCompletionChunk.model_validate_json(raw[6:])
              for line in lines for raw in writer.chunks(line)]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    streamed: dict[int, list[str]] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            assert d.function is not None
            if d.id is not None:
                streamed[d.index] = [d.function.name or "", ""]
            streamed[d.index][1] += d.function.arguments or ""
    assert content == choice.message.content
    assert [(n, json.loads(a)) for n, a in streamed.values()] == WANT
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        "tool_calls"]


@pytest.mark.parametrize("parser", PARSERS)
def test_required_and_named_calls_get_a_grammar_and_an_opening(parser: str) -> None:
    from cleave.runtime.engine.sequence import SamplingParams

    required = api.parse_chat_request({**CHAT, "tools": [TOOL, TOOL_G],
                                       "tool_choice": "required"}, ["m"]).tool_request
    assert required is not None and required.choice == "required"
    constrained = tools.constrain(SamplingParams(max_tokens=9), required, parser)
    assert constrained.grammar is not None and constrained.max_tokens == 9
    assert tools.generation_suffix(required, parser) == ("<tool_call>\n" if parser == HERMES
                                                         else "")
    plan = tools.plan(required, parser)
    assert plan is not None
    stream = plan.stream()  # reads the opening first: the grammar's call is a call
    body = json.dumps({"name": "g", tools.arguments_key(parser): {"x": 1}})
    assert collect(stream.feed(body) + stream.finish())[1][0].name == "g"
    auto = api.parse_chat_request({**CHAT, "tools": [TOOL]}, ["m"]).tool_request
    assert tools.constrain(SamplingParams(max_tokens=9), auto, parser).grammar is None
    named = api.parse_chat_request({**CHAT, "tools": [TOOL], "tool_choice": "required"},
                                   ["m"]).tool_request
    with pytest.raises(api.APIError) as e:  # two grammars cannot hold at once
        tools.constrain(SamplingParams(max_tokens=9, grammar="start: \"a\""), named, parser)
    assert e.value.param == "tool_choice"
    with pytest.raises(api.APIError) as e:
        tools.constrain(SamplingParams(max_tokens=9, ignore_eos=True), named, parser)
    assert e.value.param == "ignore_eos"
