"""The workers' token lines as the router's responses: whole responses, stream chunks, usage,
SSE framing (logprobs: logprobs.py). Every body is built through its model (response_models.py:
the shapes the official ``openai`` client parses, and what the OpenAPI document states);
``StreamWriter`` and ``final_response`` are what the router uses.

The cost of validating every streamed chunk is about a microsecond: a chunk's parts are built as
plain dicts and the chunk validated once, whole, by its model, then serialized by it
(StreamWriter.chunks, best of 25 runs on the 2-core dev machine, one token a chunk): a chat
delta 5.8 us against 4.8 for the dicts and ``json.dumps`` it replaced, with top-2 logprobs
13.7 against 11.3; a completion chunk 5.0 against 4.3. Nesting the models' constructors instead
costs about twice that with logprobs (each small model is a Python call), and
``model_construct``, which validates nothing, was slower still.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from aiohttp import web
from pydantic import BaseModel

from cleave.runtime.engine.sequence import FinishReason, TokenLogprob
from cleave.runtime.serving import response_models as rm
from cleave.runtime.serving.logprobs import MIN_LOGPROB as MIN_LOGPROB
from cleave.runtime.serving.logprobs import PromptScores, chat_logprobs, line_logprobs
from cleave.runtime.serving.logprobs import completion_logprobs as completion_logprobs
from cleave.runtime.serving.tool_parsers import ToolCall, ToolCallStream, ToolDelta, collect
from cleave.runtime.serving.wire import TokenLine

JSONObject = dict[str, Any]
APIFinishReason = rm.FinishReason
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


def tool_calls(calls: Sequence[ToolCall]) -> list[JSONObject]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def tool_deltas(deltas: Sequence[ToolDelta]) -> list[JSONObject]:
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
          cached_tokens: int | None = 0) -> rm.CompletionUsage:
    """None: no ``prompt_tokens_details`` (null, as vLLM without
    --enable-prompt-tokens-details); the router hides them so (its worker lines carry no
    ``cached_tokens``) when told to."""
    return rm.CompletionUsage.of(prompt_tokens, completion_tokens, cached_tokens)


# The parts below (and logprobs.py's) are plain dicts, in the models' shapes: each response is
# validated once, whole, by its model (which also clamps -inf and NaN logprobs).

def _completion_choice(index: int, text: str, finish_reason: FinishReason | str,
                       logprobs: JSONObject | None) -> JSONObject:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": api_finish_reason(finish_reason)}


def _chat_choice(index: int, text: str, finish_reason: FinishReason | str,
                 logprobs: JSONObject | None, calls: Sequence[ToolCall] = ()) -> JSONObject:
    message: JSONObject = {"content": text}
    if calls:  # OpenAI's: null content when the answer is only calls
        message.update(content=text or None, tool_calls=tool_calls(calls))
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": api_finish_reason(_tool_reason(finish_reason, bool(calls)))}


def completion_chunk(request_id: str, created: int, model: str, text: str,
                     finish_reason: FinishReason | str | None = None,
                     logprobs: JSONObject | None = None, index: int = 0) -> rm.CompletionChunk:
    return rm.CompletionChunk.model_validate({
        "id": request_id, "created": created, "model": model, "choices": [{
            "index": index, "text": text, "logprobs": logprobs,
            "finish_reason": _finish(finish_reason)}]})


def chat_chunk(request_id: str, created: int, model: str, delta_text: str | None,
               role_first: bool, finish_reason: FinishReason | str | None = None,
               logprobs: JSONObject | None = None, index: int = 0,
               tool_calls: Sequence[ToolDelta] = ()) -> rm.ChatCompletionChunk:
    """One streamed chat delta. The first chunk carries the role (OpenAI sends it with empty
    content); the last may carry only the finish reason, with an empty delta."""
    delta: JSONObject = {"role": "assistant", "content": ""} if role_first else {}
    if delta_text is not None:
        delta["content"] = delta_text
    if tool_calls:
        delta["tool_calls"] = tool_deltas(tool_calls)
    return rm.ChatCompletionChunk.model_validate({
        "id": request_id, "created": created, "model": model, "choices": [{
            "index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": _finish(finish_reason)}]})


def usage_chunk(request_id: str, created: int, model: str, usage: rm.CompletionUsage,
                *, chat: bool) -> rm.CompletionChunk | rm.ChatCompletionChunk:
    """The extra last chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
    kind = rm.ChatCompletionChunk if chat else rm.CompletionChunk
    return kind(id=request_id, created=created, model=model, choices=[], usage=usage)


def models_list(models: Sequence[str], created: int, max_model_len: int, root: str,
                owned_by: str = "cleave") -> rm.ModelList:
    """vLLM's entries (response_models.ModelCard)."""
    return rm.ModelList(data=[rm.ModelCard(id=m, created=created, owned_by=owned_by, root=root,
                                           max_model_len=max_model_len) for m in models])


def json_reply(body: BaseModel, status: int = 200,
               headers: Mapping[str, str] | None = None) -> web.Response:
    """A whole JSON response from its model: compact, UTF-8 as is."""
    return web.Response(body=body.model_dump_json().encode(), status=status, headers=headers,
                        content_type="application/json", charset="utf-8")


def sse(data: BaseModel) -> bytes:
    """One server-sent event: compact JSON, UTF-8 as is (JSON needs no escapes for it)."""
    return b"data: " + data.model_dump_json().encode() + b"\n\n"


def _total_usage(finals: Sequence[TokenLine]) -> rm.CompletionUsage:
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
        # Put in front of each choice's text: completions, the prompt's text; chat, the last
        # message's when it is the assistant's (vLLM's echo), past the tool-call parser.
        self.echo = echo
        self.started: set[int] = set()
        self.offsets = [0] * choices
        self.finals: list[TokenLine] = []
        self.tools = [tools() for _ in range(choices)] if tools is not None else None
        # Streamed, only an echo shows them (protocol refuses prompt_logprobs with stream).
        self.prompt = prompt if prompt is not None and prompt.echo_top is not None else None

    def heavy(self, index: int) -> bool:
        """Whether choice ``index``'s next chunk carries the echoed prompt's logprobs (its
        first does): one worth building off the event loop."""
        return self.prompt is not None and index not in self.started

    def chunks(self, line: TokenLine, index: int = 0) -> list[bytes]:
        text = line.text
        first = index not in self.started
        self.started.add(index)
        if first and self.echo and not self.chat:
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
        if first:
            text = self.echo + text
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
                   prompt: PromptScores | None = None) -> rm.Completion | rm.ChatCompletion:
    """The whole (non-streamed) response from every line of each finished choice, in order;
    ``echo`` as StreamWriter's; ``prompt`` has taken its scores from the lines (before any were
    ranked out)."""
    built = []
    scores = prompt.field(token_text) if prompt is not None and prompt.top is not None \
        else None
    for index, lines in enumerate(choices):
        text = "".join(line.text for line in lines)
        lps = [lp for line in lines for lp in line_logprobs(line)] if want_logprobs else []
        reason = lines[-1].finish_reason or "stop"
        if chat:
            text, calls = _with_tools(text, tools)
            built.append(_chat_choice(index, echo + text, reason, chat_logprobs(
                lps, token_text) if want_logprobs else None, calls))
            continue
        head: list[int] = []
        if prompt is not None and prompt.echo_top is not None:  # the echo's tokens are scored
            head, lps = prompt.echoed(lps)
        built.append(_completion_choice(index, echo + text, reason, completion_logprobs(
            lps, token_text, 0 if head else len(echo), head) if want_logprobs else None))
    kind = rm.ChatCompletion if chat else rm.Completion
    whole = kind.model_validate({
        "id": request_id, "created": int(time.time()), "model": model, "choices": built,
        "usage": _total_usage([lines[-1] for lines in choices])})
    if scores is None:
        return whole
    # Validated once, by field(): each choice holds that one list, not a copy validated again
    # (n copies cost n times the prompt's scores, which can take seconds).
    if isinstance(whole, rm.ChatCompletion):  # vLLM's: on the response
        return whole.model_copy(update={"prompt_logprobs": scores})
    return whole.model_copy(update={"choices": [  # vLLM's: on each choice
        c.model_copy(update={"prompt_logprobs": scores}) for c in whole.choices]})
