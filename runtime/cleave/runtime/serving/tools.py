"""Tool calling on ``/v1/chat/completions``: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, which parser reads the model's calls, and the chat messages of a tool
round trip (assistant ``tool_calls``, ``tool`` results) as chat templates take them.

The tools go to the model's own chat template (``apply_chat_template(tools=...)``), which writes
them into the prompt in the format the model was trained on; ``tool_parsers.py`` reads the calls
back. As vLLM does, a call that must be made is made by guided decoding (the structured-output
grammar, structured_fields.py):

- ``auto``: the model decides; its calls are parsed, anything else is content.
- ``none``: no calls: the output is content, never parsed.
- a named function (or ``required`` with one tool): the router writes the call's opening
  (``<tool_call>{"name": ..., "arguments": `` in Hermes' format) after the generation prompt, and
  the arguments follow the function's ``parameters`` schema (a grammar), then the answer ends.
- ``required`` with several tools: the router writes ``<tool_call>`` (Hermes) and the grammar
  allows exactly one call of one of the tools, its arguments following that tool's schema.
- ``strict: true`` on a function: held by the grammar with ``required`` or a named choice; a 400
  with ``auto`` and ``none`` (the model's free text is not constrained).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from cleave.common.settings import TOOL_CALL_PARSERS
from cleave.runtime.engine.sequence import RequestError, SamplingParams
from cleave.runtime.serving import structured_fields
from cleave.runtime.serving.chat_models import NamedChoice, Tool
from cleave.runtime.serving.json_fields import APIError, bad
from cleave.runtime.serving.request_types import fail
from cleave.runtime.serving.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    PARSERS,
    ToolCallStream,
    arguments_key,
    forced_prefix,
)

AUTO: Final = "auto"
PARSER_CHOICES: Final = TOOL_CALL_PARSERS  # --tool-call-parser
JSONObject = dict[str, Any]
ToolChoiceValue = str | NamedChoice


@dataclass(frozen=True)
class ToolRequest:
    """The request's tools (as the template takes them) and what it asks of them."""
    tools: tuple[JSONObject, ...]
    choice: str  # "auto", "none", "function" (named) or "required" (one of several)
    name: str | None = None  # the function a named (or single-tool required) choice calls
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> list[JSONObject]:
        """As templates take them: without 'strict', which is ours to enforce."""
        return [{"type": "function", "function": {k: v for k, v in t["function"].items()
                                                  if k != "strict"}} for t in self.tools]


def parse_tools(tools: Sequence[Tool], choice: ToolChoiceValue | None,
                parallel: bool) -> ToolRequest | None:
    """The request's validated tool fields (chat_models.py) as one request; None when it has no
    tools (and asks for none). Raises the rules a schema cannot state, naming the field."""
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise fail("'tools' names a function twice", "tools")
    kind, name = _choice(choice, names)
    if not tools:
        return None  # "none" and "auto" without tools: plain text, as before
    strict = [i for i, t in enumerate(tools) if t.function.strict]
    if strict and kind in ("auto", "none"):
        raise fail("'strict' functions need 'tool_choice' 'required' or a named function: with "
                   "'auto' the model's arguments are not constrained",
                   f"tools[{strict[0]}].function.strict")
    return ToolRequest(tuple(t.as_json() for t in tools), kind, name, parallel)


def _choice(v: ToolChoiceValue | None, names: list[str]) -> tuple[str, str | None]:
    if v is None:
        return (AUTO, None) if names else ("none", None)
    if v in ("auto", "none"):
        return str(v), None
    if v == "required":
        if not names:
            raise fail("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return ("function", names[0]) if len(names) == 1 else ("required", None)
    assert isinstance(v, NamedChoice)
    if v.function.name not in names:
        raise fail(f"'tool_choice' names '{v.function.name}', which is not in 'tools'",
                   "tool_choice")
    return "function", v.function.name


def resolve_parser(flag: str, chat_template: object) -> str | None:
    """The parser ``--tool-call-parser`` names; ``auto``: the one the chat template's format
    shows (None: the template takes no tools, and a request with tools gets a 400)."""
    if flag != AUTO:
        return None if flag == "none" else flag
    template = chat_template if isinstance(chat_template, str) else json.dumps(chat_template)
    if "<tool_call>" in template:
        return HERMES  # Hermes, Qwen2.5, Qwen3
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template):
        return LLAMA3_JSON  # Llama 3.1 to 3.3
    return None


def generation_suffix(request: ToolRequest | None, parser: str | None) -> str:
    """Text the router writes after the generation prompt: a required call's opening."""
    if request is None or request.choice not in ("function", "required") or parser is None:
        return ""
    return forced_prefix(parser, request.name)


def _grammar_schema(request: ToolRequest, parser: str) -> JSONObject:
    """What follows the router's opening: the named function's arguments, or one call of any
    of the tools."""
    functions = [t["function"] for t in request.tools]
    if request.choice == "function":
        return next(f["parameters"] for f in functions if f["name"] == request.name)
    key = arguments_key(parser)
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                        key: f["parameters"]},
                       "required": ["name", key], "additionalProperties": False}
                      for f in functions]}


def constrain(params: SamplingParams, request: ToolRequest | None,
              parser: str | None) -> SamplingParams:
    """``params`` with the grammar a required or named call follows."""
    if request is None or parser is None or request.choice not in ("function", "required"):
        return params
    if params.grammar is not None:
        raise bad("tool_choice", "a required or named 'tool_choice' cannot be combined with "
                  "a structured output (response_format, guided_*)")
    try:
        grammar = structured_fields.grammar({"guided_json": _grammar_schema(request, parser)})
        return replace(params, grammar=grammar)
    except APIError as e:
        raise bad("tools", f"the tools' parameters do not make a grammar: {e.message}") from None
    except RequestError as e:  # ignore_eos: a complete grammar allows only EOS
        raise bad("ignore_eos", str(e)) from None


@dataclass(frozen=True)
class ToolPlan:
    """How the router serves one request's tools: the parser, the named call it opened, or the
    opening it wrote for a required call (which the parser reads first)."""
    parser: str
    forced: str | None
    single: bool
    opening: str = ""

    def stream(self) -> ToolCallStream:
        stream = ToolCallStream(self.parser, self.forced, self.single)
        stream.feed(self.opening)  # a call's opening: held, nothing to send
        return stream


def plan(request: ToolRequest | None, parser: str | None) -> ToolPlan | None:
    """None when nothing is parsed (no tools, or ``tool_choice: none``); a 400 when the model
    has no tool-call format to parse."""
    if request is None or not request.parses:
        return None
    if parser is None:
        raise bad("tools", "this model's chat template has no tool-call format Cleave can "
                  f"parse; start the router with --tool-call-parser ({', '.join(PARSERS)})")
    if request.choice == "required":
        return ToolPlan(parser, None, not request.parallel, forced_prefix(parser, None))
    return ToolPlan(parser, request.name if request.choice == "function" else None,
                    not request.parallel)

