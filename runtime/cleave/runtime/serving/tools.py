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
from dataclasses import dataclass, replace
from typing import Any, Final

from cleave.common.settings import TOOL_CALL_PARSERS
from cleave.runtime.engine.sequence import RequestError, SamplingParams
from cleave.runtime.serving import structured_fields
from cleave.runtime.serving.json_fields import APIError, bad, read_bool
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
MAX_TOOLS: Final = 128  # OpenAI's limit
_NAME_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
JSONObject = dict[str, Any]


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


def _tool(v: object, i: int) -> JSONObject:
    param = f"tools[{i}]"
    fn = v.get("function") if isinstance(v, dict) else None
    if not (isinstance(v, dict) and v.get("type") == "function" and isinstance(fn, dict)
            and set(v) <= {"type", "function"}):
        raise bad(param, f"'{param}' must be {{\"type\": \"function\", \"function\": {{...}}}}")
    name = fn.get("name")
    if not (isinstance(name, str) and 0 < len(name) <= 64 and set(name) <= _NAME_CHARS):
        raise bad(f"{param}.function.name", f"'{param}.function.name' must be 1 to 64 "
                  "letters, digits, underscores or dashes")
    if not isinstance(fn.get("description", ""), str):
        raise bad(f"{param}.function.description", "a function's 'description' must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad(f"{param}.function.parameters", "a function's 'parameters' must be a JSON "
                  "schema (an object)")
    if fn.get("strict") not in (None, False, True):
        raise bad(f"{param}.function.strict", f"'{param}.function.strict' must be a boolean")
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise bad(f"{param}.function", f"unknown field '{sorted(unknown)[0]}' in a function")
    out: JSONObject = {"name": name, "parameters": params, "strict": fn.get("strict") is True}
    if "description" in fn:
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def _choice(v: object, names: list[str]) -> tuple[str, str | None]:
    if v is None:
        return (AUTO, None) if names else ("none", None)
    if v in ("auto", "none"):
        return str(v), None
    if v == "required":
        if not names:
            raise bad("tool_choice", "'tool_choice' 'required' needs 'tools'")
        return ("function", names[0]) if len(names) == 1 else ("required", None)
    fn = v.get("function") if isinstance(v, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(v, dict) and v.get("type") == "function" and isinstance(name, str)):
        raise bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                  '{"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise bad("tool_choice", f"'tool_choice' names '{name}', which is not in 'tools'")
    return "function", name


def parse_tools(body: JSONObject) -> ToolRequest | None:
    """The request's tool fields, validated; None when it has no tools (and asks for none)."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and len(tools) <= MAX_TOOLS):
        raise bad("tools", f"'tools' must be a list of at most {MAX_TOOLS} functions")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools or []))
    names = [t["function"]["name"] for t in parsed]
    if len(set(names)) < len(names):
        raise bad("tools", "'tools' names a function twice")
    choice, name = _choice(body.get("tool_choice"), names)
    parallel = read_bool(body, "parallel_tool_calls")
    if not parsed:
        return None  # "none" and "auto" without tools: plain text, as before
    strict = [i for i, t in enumerate(parsed) if t["function"]["strict"]]
    if strict and choice in ("auto", "none"):
        raise bad(f"tools[{strict[0]}].function.strict", "'strict' functions need "
                  "'tool_choice' 'required' or a named function: with 'auto' the model's "
                  "arguments are not constrained")
    return ToolRequest(parsed, choice, name, True if parallel is None else parallel)


def template_tool_calls(v: object, param: str) -> tuple[JSONObject, ...]:
    """An assistant message's ``tool_calls`` as templates take them: arguments as an object
    (templates print them with ``tojson``), as vLLM passes them."""
    if not isinstance(v, list):
        raise bad(param, f"'{param}' must be a list of tool calls")
    out = []
    for j, call in enumerate(v):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and call.get("type", "function") == "function"
                and isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str)):
            raise bad(f"{param}[{j}]", f"'{param}[{j}]' must be {{\"id\": ..., \"type\": "
                      '"function", "function": {"name": <string>, "arguments": <string>}}')
        try:
            args: object = json.loads(fn["arguments"])
        except ValueError:
            args = fn["arguments"]  # a call's text as the model wrote it, passed on as such
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return tuple(out)


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

