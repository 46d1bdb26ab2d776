"""Tool calls out of a model's text, whole or as it streams (``--tool-call-parser``).

Two formats cover the supported families: Hermes/Qwen (``<tool_call>{"name": ..., "arguments":
...}</tool_call>``, any number of them amid text) and Llama 3.x JSON (the whole answer is
``{"name": ..., "parameters": ...}``, optionally after ``<|python_tag|>``, several joined by
``;``). One incremental parser serves both streamed and whole responses, so the two always
agree: text that may still become a call is held back until it is one (then it is a call) or is
not (then it is text). A call that is not a JSON object with a string ``name`` and an object of
arguments is the model's text, returned as content, as vLLM's parsers do.

With a named ``tool_choice`` the router writes the call's opening itself (``forced_prefix``),
so the call and its name are certain; its arguments (held to the function's schema by a
grammar, tools.py) stream as the model writes them and the call ends when their object closes
(``ArgumentsScanner``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Final

HERMES: Final = "hermes"
LLAMA3_JSON: Final = "llama3_json"
PARSERS: Final = (HERMES, LLAMA3_JSON)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG: Final = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it (OpenAI's field is a string too)
    id: str = ""

    def with_id(self) -> ToolCall:
        return ToolCall(self.name, self.arguments, "chatcmpl-tool-" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class ToolDelta:
    """A piece of call ``index``: its first piece has the id and name, the rest ``arguments``
    text to append (OpenAI's streamed ``tool_calls`` entries)."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Event = str | ToolDelta  # content text, or a piece of a call


def _call(obj: object, args_key: str) -> ToolCall | None:
    """``obj`` as a call, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_hermes_block(block: str) -> ToolCall | None:
    """The JSON between ``<tool_call>`` and ``</tool_call>``."""
    return _call(_json(block.strip()), "arguments")


def parse_llama3(text: str) -> list[ToolCall] | None:
    """A whole Llama 3.x answer as calls, or None when it is not only calls."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return None
        call = _call(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":  # vLLM's separator, and space
            at += 1
    return calls


def _held_prefix(text: str, marker: str) -> int:
    """Where a tail of ``text`` that could be the start of ``marker`` begins (len: none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


class ArgumentsScanner:
    """Finds where a JSON object's text ends, fed piece by piece (strings and escapes
    understood)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """How much of ``text`` belongs to the object when it closes in it, else None."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ToolCallStream:
    """A response's text in, content and tool-call pieces out (see the module's docstring).

    ``forced``: the call the router opened for a named ``tool_choice``; ``single``: only the
    first call is kept (``parallel_tool_calls: false``)."""

    def __init__(self, parser: str, forced: str | None = None, single: bool = False) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}")
        self.parser = parser
        self.single = single
        self.pending = ""  # text held back: maybe (part of) a call
        self.in_call = False  # hermes: inside <tool_call>
        self.calls = 0
        self.done = False  # a forced call is complete: the rest of the output is dropped
        self.started = False  # llama3: the first non-space character was seen
        self.scanner: ArgumentsScanner | None = None
        self.forced = forced
        if forced is not None:
            self.scanner = ArgumentsScanner()

    def _emit(self, call: ToolCall) -> list[Event]:
        if self.single and self.calls:
            return []
        self.calls += 1
        call = call.with_id()
        # Two pieces, as OpenAI streams them: the call's id and name, then its arguments.
        return [ToolDelta(self.calls - 1, "", call.id, call.name),
                ToolDelta(self.calls - 1, call.arguments)]

    def feed(self, text: str) -> list[Event]:
        if self.done or not text:
            return []
        if self.scanner is not None:
            return self._feed_forced(text)
        if self.parser == HERMES:
            return self._feed_hermes(text)
        return self._feed_llama3(text)

    def _feed_forced(self, text: str) -> list[Event]:
        assert self.scanner is not None and self.forced is not None
        out: list[Event] = []
        if not self.calls:
            self.calls = 1
            out.append(ToolDelta(0, "", ToolCall(self.forced, "").with_id().id, self.forced))
        end = self.scanner.feed(text)
        if end is not None:
            self.done = True
            text = text[:end]
        if text:
            out.append(ToolDelta(0, text))
        return out

    def _feed_hermes(self, text: str) -> list[Event]:
        self.pending += text
        out: list[Event] = []
        while True:
            if self.in_call:
                end = self.pending.find(_CLOSE)
                if end < 0:
                    return out
                block = self.pending[:end]
                self.pending = self.pending[end + len(_CLOSE):]
                self.in_call = False
                call = parse_hermes_block(block)
                out += self._emit(call) if call else [_OPEN + block + _CLOSE]
                continue
            start = self.pending.find(_OPEN)
            if start < 0:
                keep = _held_prefix(self.pending, _OPEN)
                if keep:
                    out.append(self.pending[:keep])
                self.pending = self.pending[keep:]
                return out
            if start:
                out.append(self.pending[:start])
            self.pending = self.pending[start + len(_OPEN):]
            self.in_call = True

    def _feed_llama3(self, text: str) -> list[Event]:
        if not self.started:
            self.pending += text
            head = self.pending.lstrip()
            if not head or (_PYTHON_TAG.startswith(head) and head != _PYTHON_TAG):
                return []
            self.started = True
            if head.startswith(("{", _PYTHON_TAG)):
                return []  # maybe calls: held until the end
            text, self.pending = self.pending, ""
            self.parser = "text"
            return [text]
        if self.parser == "text":
            return [text]
        self.pending += text
        return []

    def finish(self) -> list[Event]:
        """The end of the output: what was held back, as calls or as text."""
        text, self.pending = self.pending, ""
        if self.done or self.scanner is not None:
            return []  # a forced call cut short by max_tokens: its arguments as written
        if self.parser == HERMES:
            if not self.in_call:
                return [text] if text else []
            call = parse_hermes_block(text)  # an unclosed last call (EOS before the tag)
            return self._emit(call) if call else [_OPEN + text]
        if self.parser == LLAMA3_JSON and text:
            calls = parse_llama3(text)
            if calls is not None:
                return [e for call in calls for e in self._emit(call)]
        return [text] if text else []

    @property
    def has_calls(self) -> bool:
        return self.calls > 0


def arguments_key(parser: str) -> str:
    return "parameters" if parser == LLAMA3_JSON else "arguments"


def forced_prefix(parser: str, name: str | None) -> str:
    """What the router writes at the start of the answer when a call is required: a call's
    opening in the parser's format, up to the arguments of function ``name`` when named."""
    opening = "" if name is None else \
        json.dumps({"name": name})[:-1] + f', "{arguments_key(parser)}": '
    return f"{_OPEN}\n{opening}" if parser == HERMES else opening


def collect(events: list[Event]) -> tuple[str, list[ToolCall]]:
    """Whole-response view: the content and the calls assembled from their pieces."""
    content, calls = [], []  # calls: [id, name, arguments]
    for e in events:
        if isinstance(e, str):
            content.append(e)
        elif e.id is not None:
            calls.append([e.id, e.name or "", e.arguments])
        else:
            calls[e.index][2] += e.arguments
    return "".join(content), [ToolCall(n, a, i) for i, n, a in calls]
