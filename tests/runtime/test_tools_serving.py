"""Tool calling through the whole platform (issue 16 item 4), with the official ``openai``
client: real prefill and decode workers, a real redis-server and the router, on the tiny random
Llama given a Hermes/Qwen-style tool chat template (so ``--tool-call-parser auto`` picks
``hermes``).

A random model does not choose to call a tool, so the round trip uses a named ``tool_choice``:
the router writes the call's opening (``<tool_call>{"name": "get_weather", "arguments": ``), the
grammar of the function's parameters makes ``{`` the first token, and ``logit_bias`` makes ``}``
the next, which completes the arguments (the grammar then allows only EOS). ``required`` with
several tools makes the random model write one valid call of one of them. The parser's handling
of the model's own calls, in both formats and in every streamed split, is in
test_tools_parsers.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from response_support import checked_client, checked_post
from serving_stack import Stack, start_stack
from transformers import AutoTokenizer

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\nReturn calls as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- elif message.tool_calls %}<|im_start|>assistant"
    "{%- for tc in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that writes tools and tool turns."""
    path = tmp_path_factory.mktemp("tool-model") / "model"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def stack(tool_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tool_model, tmp_path_factory.mktemp("tools-logs"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return checked_client(stack.base_url)  # every response held to the schema


@pytest.fixture(scope="module")
def close_brace(tool_model: Path) -> dict[str, float]:
    """logit_bias making '}' certain."""
    [token] = AutoTokenizer.from_pretrained(str(tool_model)).encode(
        "}", add_special_tokens=False)
    return {str(token): 100.0}


def _post(stack: Stack, path: str, body: dict[str, Any]) -> Any:
    assert stack.router is not None
    status, reply = checked_post(stack.router.url + path, json.dumps(body).encode())
    assert status == 200, reply
    return reply


def test_a_tool_call_round_trips(stack: Stack, client: openai.OpenAI,
                                 close_brace: dict[str, float]) -> None:
    first = client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice=NAMED, temperature=0, logit_bias=close_brace)  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {}
    # The call ended the answer ('{', '}', EOS), though max_tokens was the rest of the context.
    assert first.usage is not None and first.usage.completion_tokens <= 3
    # The follow-up: the assistant's call as the client parsed it, and the tool's result.
    history = [*QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}]
    follow = client.chat.completions.create(model="tiny", messages=history,  # type: ignore[arg-type]
                                            tools=[WEATHER], max_tokens=4, temperature=0)
    assert follow.choices[0].finish_reason == "length" and follow.choices[0].message.content
    # What the model saw: the call and its result, written by the template.
    ids = _post(stack, "/tokenize", {"messages": history})["tokens"]
    prompt = _post(stack, "/detokenize", {"tokens": ids})["prompt"]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>' in prompt
            and "<tool_response>\n22 degrees, sunny\n</tool_response>" in prompt)


def test_a_named_call_streams_as_tool_call_deltas(client: openai.OpenAI,
                                                  close_brace: dict[str, float]) -> None:
    chunks = list(client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=NAMED, temperature=0, logit_bias=close_brace,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True}))
    deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []]
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].type == "function"
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    # The arguments stream as the model writes them: '{' with the name, then '}'.
    assert [d.function.arguments for d in deltas if d.function] == ["{", "}"]
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == "{}"
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == [
        "tool_calls"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 3
    assert not any(ch.delta.content for c in chunks for ch in c.choices)


def test_auto_and_none_leave_text_as_content(client: openai.OpenAI,
                                             close_brace: dict[str, float]) -> None:
    for choice in ("auto", "none"):
        out = client.chat.completions.create(
            model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice=choice,  # type: ignore[list-item, arg-type]
            temperature=0, logit_bias=close_brace, max_tokens=3)
        assert out.choices[0].message.content == "}}}"
        assert out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason == "length"


def test_required_makes_one_valid_call_of_one_of_the_tools(client: openai.OpenAI,
                                                           tool_model: Path) -> None:
    # '"' and '}' made likelier: the random model's strings and objects end within max_tokens.
    tokenizer = AutoTokenizer.from_pretrained(str(tool_model))
    ends = {str(t): 5.0 for t in tokenizer.encode('"}', add_special_tokens=False)}
    for seed in range(3):
        out = client.chat.completions.create(
            model="tiny", messages=QUESTION, tools=[WEATHER, CLOCK],  # type: ignore[list-item]
            tool_choice="required", temperature=1, seed=seed, max_tokens=150, logit_bias=ends)
        [call] = out.choices[0].message.tool_calls or []
        args = json.loads(call.function.arguments)
        assert out.choices[0].finish_reason == "tool_calls", out
        assert call.function.name in ("get_weather", "now") and isinstance(args, dict)
        if call.function.name == "get_weather":
            # The schema's: a string city (other keys are allowed, as JSON schema allows them).
            assert isinstance(args.get("city", ""), str)


def test_what_cannot_be_guaranteed_is_refused(client: openai.OpenAI) -> None:
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=QUESTION,  # type: ignore[arg-type]
                                       tools=[strict])  # type: ignore[list-item]
    assert e.value.body["param"] == "tools[0].function.strict"  # type: ignore[index]
