"""OpenAI response shapes: whole responses, stream chunks, usage, SSE framing (logprobs:
logprobs.py).

Plain dicts in exactly the shapes the official ``openai`` client parses (tests check them with
its own models). ``StreamWriter`` and ``final_response`` turn the workers' token lines into
them for the router.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

from cleave.runtime.engine.sequence import FinishReason, TokenLogprob
from cleave.runtime.serving.logprobs import MIN_LOGPROB as MIN_LOGPROB
from cleave.runtime.serving.logprobs import PromptScores, chat_logprobs, line_logprobs
from cleave.runtime.serving.logprobs import completion_logprobs as completion_logprobs
from cleave.runtime.serving.tool_parsers import ToolCall, ToolCallStream, ToolDelta, collect
from cleave.runtime.serving.wire import TokenLine

JSONObject = dict[str, Any]
APIFinishReason = Literal["stop", "length", "tool_calls"]
TOOL_CALLS: Final = "tool_calls"
# A new parser per choice (None: the request parses no tool calls).
ToolStreams = Callable[[], ToolCallStream] | None
SSE_DONE: Final = b"data: [DONE]\n\n"


def api_finish_reason(reason: FinishReason | str) -> APIFinishReason:
    """OpenAI knows "stop", "length" and "tool_calls" (the router's own, tools.py): an abort
    (or a prefill hand-off) reads as a stop."""
    if reason == TOOL_CALLS:
        return TOOL_CALLS
    return "length" if reason == FinishReason.LENGTH else "stop"


def _tool_reason(reason: FinishReason | str, has_calls: bool) -> FinishReason | str:
    """A choice that called tools finished for that, unless it was cut short."""
    return TOOL_CALLS if has_calls and reason != FinishReason.LENGTH else reason


def tool_calls_json(calls: Sequence[ToolCall]) -> list[JSONObject]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def tool_deltas_json(deltas: Sequence[ToolDelta]) -> list[JSONObject]:
    """Streamed pieces: the first of a call has its id, type and name; the rest, arguments.
    Pieces of one call in one chunk are one entry (clients expect an index once per delta)."""
    out: list[JSONObject] = []
    for d in deltas:
        if out and d.id is None and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
            continue
        fn: JSONObject = {"arguments": d.arguments}
        entry: JSONObject = {"index": d.index, "function": fn}
        if d.id is not None:
            entry.update(id=d.id, type="function")
            fn["name"] = d.name
        out.append(entry)
    return out


def _finish(reason: FinishReason | str | None) -> APIFinishReason | None:
    return None if reason is None else api_finish_reason(reason)


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = 0) -> JSONObject:
    """None: no ``prompt_tokens_details`` (null, as vLLM without
    --enable-prompt-tokens-details); the router hides them so (its worker lines carry no
    ``cached_tokens``) when told to."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": None if cached_tokens is None
            else {"cached_tokens": cached_tokens}}


def _envelope(obj: str, request_id: str, created: int, model: str,
              choices: list[JSONObject]) -> JSONObject:
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": choices}


def _completion_choice(index: int, text: str, finish_reason: FinishReason | str,
                       logprobs: JSONObject | None) -> JSONObject:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": api_finish_reason(finish_reason)}


def _chat_choice(index: int, text: str, finish_reason: FinishReason | str,
                 logprobs: JSONObject | None, calls: Sequence[ToolCall] = ()) -> JSONObject:
    message: JSONObject = {"role": "assistant", "content": text}
    if calls:  # OpenAI's: null content when the answer is only calls
        message.update(content=text or None, tool_calls=tool_calls_json(calls))
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": api_finish_reason(_tool_reason(finish_reason, bool(calls)))}


def completion_response(request_id: str, created: int, model: str, text: str,
                        finish_reason: FinishReason | str, usage: JSONObject,
                        logprobs: JSONObject | None = None) -> JSONObject:
    choice = _completion_choice(0, text, finish_reason, logprobs)
    return {**_envelope("text_completion", request_id, created, model, [choice]), "usage": usage}


def completion_chunk(request_id: str, created: int, model: str, text: str,
                     finish_reason: FinishReason | str | None = None,
                     logprobs: JSONObject | None = None, index: int = 0) -> JSONObject:
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": _finish(finish_reason)}
    return _envelope("text_completion", request_id, created, model, [choice])


def chat_response(request_id: str, created: int, model: str, text: str,
                  finish_reason: FinishReason | str, usage: JSONObject,
                  logprobs: JSONObject | None = None) -> JSONObject:
    choice = _chat_choice(0, text, finish_reason, logprobs)
    return {**_envelope("chat.completion", request_id, created, model, [choice]), "usage": usage}


def chat_chunk(request_id: str, created: int, model: str, delta_text: str | None,
               role_first: bool, finish_reason: FinishReason | str | None = None,
               logprobs: JSONObject | None = None, index: int = 0,
               tool_calls: Sequence[ToolDelta] = ()) -> JSONObject:
    """One streamed chat delta. The first chunk carries the role (OpenAI sends it with empty
    content); the last may carry only the finish reason, with an empty delta."""
    delta: JSONObject = {"role": "assistant", "content": ""} if role_first else {}
    if delta_text is not None:
        delta["content"] = delta_text
    if tool_calls:
        delta["tool_calls"] = tool_deltas_json(tool_calls)
    choice = {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": _finish(finish_reason)}
    return _envelope("chat.completion.chunk", request_id, created, model, [choice])


def usage_chunk(request_id: str, created: int, model: str, usage: JSONObject,
                *, chat: bool) -> JSONObject:
    """The extra last chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {**_envelope(obj, request_id, created, model, []), "usage": usage}


def models_list(models: Sequence[str], created: int, max_model_len: int, root: str,
                owned_by: str = "cleave") -> JSONObject:
    """vLLM's entries: OpenAI's fields plus the context length and what the model was loaded
    from (clients size prompts and pick tokenizers by them)."""
    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": owned_by, "root": root,
         "parent": None, "max_model_len": max_model_len} for m in models]}


def sse(data: Mapping[str, Any]) -> bytes:
    """One server-sent event. allow_nan=False: NaN/Infinity are not JSON and break clients."""
    return b"data: " + json.dumps(data, ensure_ascii=False, allow_nan=False,
                                  separators=(",", ":")).encode() + b"\n\n"


def _total_usage(finals: Sequence[TokenLine]) -> JSONObject:
    """One request's usage over its choices: the prompt once, every choice's tokens."""
    first = finals[0]
    return usage(first.prompt_tokens, sum(f.completion_tokens for f in finals),
                 first.cached_tokens)


class StreamWriter:
    """Turns the workers' token lines into the SSE chunks of one streamed response; with n
    choices, each line comes with its choice's index, and so does each chunk."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool,
                 token_text: Callable[[int], str], want_logprobs: bool, *, choices: int = 1,
                 echo: str = "", tools: ToolStreams = None,
                 prompt: PromptScores | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.include_usage = include_usage
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.created = int(time.time())
        self.choices = choices
        self.echo = echo  # completions: the prompt's text, in front of each choice's
        self.started: set[int] = set()
        self.offsets = [0] * choices
        self.finals: list[TokenLine] = []
        self.tools = [tools() for _ in range(choices)] if tools is not None else None
        # Streamed, only an echo shows them (protocol refuses prompt_logprobs with stream).
        self.prompt = prompt if prompt is not None and prompt.echo_top is not None else None

    def chunks(self, line: TokenLine, index: int = 0) -> list[bytes]:
        text = line.text
        first = index not in self.started
        self.started.add(index)
        if first and self.echo:
            text = self.echo + text
        finished = line.finished
        reason = line.finish_reason if finished else None
        lps = line_logprobs(line) if self.want_logprobs else []
        head: list[int] = []
        if self.prompt is not None:
            self.prompt.take(line)  # sequence 0's first line comes before any other's
            if first:
                head, lps = self.prompt.echoed(lps)
        out: list[bytes] = []
        if self.chat:
            out += self._chat_chunks(text, first, reason, lps, index)
        elif text or finished or lps:
            logprobs = (completion_logprobs(lps, self.token_text, self.offsets[index], head)
                        if lps or head else None)
            out.append(sse(completion_chunk(self.request_id, self.created, self.model, text,
                                            reason, logprobs, index)))
        self.offsets[index] += len(text)
        if finished:
            self.finals.append(line)
            if self.include_usage and len(self.finals) == self.choices:
                out.append(sse(usage_chunk(self.request_id, self.created, self.model,
                                           _total_usage(self.finals), chat=self.chat)))
        return out


    def _chat_chunks(self, text: str, first: bool, reason: FinishReason | str | None,
                     lps: list[TokenLogprob], index: int) -> list[bytes]:
        deltas: list[ToolDelta] = []
        if self.tools is not None:  # the text goes through the choice's tool-call parser
            stream = self.tools[index]
            events = stream.feed(text) + (stream.finish() if reason is not None else [])
            text = "".join(e for e in events if isinstance(e, str))
            deltas = [e for e in events if isinstance(e, ToolDelta)]
            if reason is not None:
                reason = _tool_reason(reason, stream.has_calls)
        if not (text or deltas or first or reason is not None or lps):
            return []
        logprobs = chat_logprobs(lps, self.token_text) if lps else None
        return [sse(chat_chunk(self.request_id, self.created, self.model, text or None, first,
                               reason, logprobs, index, deltas))]


def _with_tools(text: str, tools: ToolStreams) -> tuple[str, list[ToolCall]]:
    if tools is None:
        return text, []
    stream = tools()
    return collect(stream.feed(text) + stream.finish())


def final_response(request_id: str, model: str, chat: bool,
                   choices: Sequence[Sequence[TokenLine]],
                   token_text: Callable[[int], str], want_logprobs: bool,
                   echo: str = "", tools: ToolStreams = None,
                   prompt: PromptScores | None = None) -> JSONObject:
    """The whole (non-streamed) response from every line of each finished choice, in order;
    ``prompt`` has taken its scores from the lines (before any were ranked out)."""
    built = []
    scores = prompt.field(token_text) if prompt is not None and prompt.top is not None \
        else None
    for index, lines in enumerate(choices):
        text = echo + "".join(line.text for line in lines)
        lps = [lp for line in lines for lp in line_logprobs(line)] if want_logprobs else []
        reason = lines[-1].finish_reason or "stop"
        if chat:
            text, calls = _with_tools(text, tools)
            built.append(_chat_choice(index, text, reason, chat_logprobs(lps, token_text)
                                      if want_logprobs else None, calls))
            continue
        head: list[int] = []
        if prompt is not None and prompt.echo_top is not None:  # the echo's tokens are scored
            head, lps = prompt.echoed(lps)
        built.append(_completion_choice(index, text, reason, completion_logprobs(
            lps, token_text, 0 if head else len(echo), head) if want_logprobs else None))
        if scores is not None:  # vLLM's: on each choice
            built[-1]["prompt_logprobs"] = scores
    obj = "chat.completion" if chat else "text_completion"
    body = {**_envelope(obj, request_id, int(time.time()), model, built),
            "usage": _total_usage([lines[-1] for lines in choices])}
    if chat and scores is not None:  # vLLM's: on the response
        body["prompt_logprobs"] = scores
    return body
