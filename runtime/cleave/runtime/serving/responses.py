"""OpenAI response shapes: whole responses, stream chunks, usage, logprobs, SSE framing.

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

JSONObject = dict[str, Any]
APIFinishReason = Literal["stop", "length"]
MIN_LOGPROB: Final = -9999.0  # OpenAI's "too unlikely to report"; JSON has no -Infinity
SSE_DONE: Final = b"data: [DONE]\n\n"


def api_finish_reason(reason: FinishReason | str) -> APIFinishReason:
    """OpenAI knows only "stop" and "length": an abort (or a prefill hand-off) reads as a stop."""
    return "length" if reason == FinishReason.LENGTH else "stop"


def _finish(reason: FinishReason | str | None) -> APIFinishReason | None:
    return None if reason is None else api_finish_reason(reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JSONObject:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN, which fails >=


def completion_logprobs(logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str],
                        text_offset: int = 0) -> JSONObject:
    """The legacy completions shape; ``text_offset`` is where these tokens start in the text
    (pass the characters already streamed when building one chunk's logprobs)."""
    tokens = [token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in logprobs],
            "top_logprobs": [{token_text(i): _lp(x) for i, x in lp.top} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(logprobs: Sequence[TokenLogprob],
                  token_text: Callable[[int], str]) -> JSONObject:
    def entry(token_id: int, logprob: float) -> JSONObject:
        text = token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, x) for i, x in lp.top]} for lp in logprobs]}


def _envelope(obj: str, request_id: str, created: int, model: str,
              choices: list[JSONObject]) -> JSONObject:
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": choices}


def completion_response(request_id: str, created: int, model: str, text: str,
                        finish_reason: FinishReason | str, usage: JSONObject,
                        logprobs: JSONObject | None = None) -> JSONObject:
    choice = {"index": 0, "text": text, "logprobs": logprobs,
              "finish_reason": api_finish_reason(finish_reason)}
    return {**_envelope("text_completion", request_id, created, model, [choice]), "usage": usage}


def completion_chunk(request_id: str, created: int, model: str, text: str,
                     finish_reason: FinishReason | str | None = None,
                     logprobs: JSONObject | None = None) -> JSONObject:
    choice = {"index": 0, "text": text, "logprobs": logprobs,
              "finish_reason": _finish(finish_reason)}
    return _envelope("text_completion", request_id, created, model, [choice])


def chat_response(request_id: str, created: int, model: str, text: str,
                  finish_reason: FinishReason | str, usage: JSONObject,
                  logprobs: JSONObject | None = None) -> JSONObject:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": logprobs, "finish_reason": api_finish_reason(finish_reason)}
    return {**_envelope("chat.completion", request_id, created, model, [choice]), "usage": usage}


def chat_chunk(request_id: str, created: int, model: str, delta_text: str | None,
               role_first: bool, finish_reason: FinishReason | str | None = None,
               logprobs: JSONObject | None = None) -> JSONObject:
    """One streamed chat delta. The first chunk carries the role (OpenAI sends it with empty
    content); the last may carry only the finish reason, with an empty delta."""
    delta: JSONObject = {"role": "assistant", "content": ""} if role_first else {}
    if delta_text is not None:
        delta["content"] = delta_text
    choice = {"index": 0, "delta": delta, "logprobs": logprobs,
              "finish_reason": _finish(finish_reason)}
    return _envelope("chat.completion.chunk", request_id, created, model, [choice])


def usage_chunk(request_id: str, created: int, model: str, usage: JSONObject,
                *, chat: bool) -> JSONObject:
    """The extra last chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {**_envelope(obj, request_id, created, model, []), "usage": usage}


def models_list(models: Sequence[str], created: int, owned_by: str = "cleave") -> JSONObject:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": created,
                                        "owned_by": owned_by} for m in models]}


def sse(data: Mapping[str, Any]) -> bytes:
    """One server-sent event. allow_nan=False: NaN/Infinity are not JSON and break clients."""
    return b"data: " + json.dumps(data, ensure_ascii=False, allow_nan=False,
                                  separators=(",", ":")).encode() + b"\n\n"


def _line_logprobs(line: Mapping[str, Any]) -> list[TokenLogprob]:
    return [TokenLogprob(int(e["token_id"]), float(e["logprob"]),
                         tuple((int(i), float(x)) for i, x in e.get("top", [])))
            for e in line.get("logprobs", [])]


def _line_usage(line: Mapping[str, Any]) -> JSONObject:
    return usage(int(line.get("prompt_tokens", 0)), int(line.get("completion_tokens", 0)),
                 int(line.get("cached_tokens", 0)))


class StreamWriter:
    """Turns a worker's token lines into the SSE chunks of one streamed response."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool,
                 token_text: Callable[[int], str], want_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.include_usage = include_usage
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.created = int(time.time())
        self.first = True
        self.offset = 0

    def chunks(self, line: Mapping[str, Any]) -> list[bytes]:
        text = str(line.get("text", ""))
        finished = bool(line.get("finished"))
        reason = line.get("finish_reason") if finished else None
        lps = _line_logprobs(line) if self.want_logprobs else []
        out: list[bytes] = []
        if self.chat:
            if text or self.first or finished or lps:
                logprobs = chat_logprobs(lps, self.token_text) if lps else None
                out.append(sse(chat_chunk(self.request_id, self.created, self.model,
                                          text or None, self.first, reason, logprobs)))
                self.first = False
        elif text or finished or lps:
            logprobs = completion_logprobs(lps, self.token_text, self.offset) if lps else None
            out.append(sse(completion_chunk(self.request_id, self.created, self.model, text,
                                            reason, logprobs)))
        self.offset += len(text)
        if finished and self.include_usage:
            out.append(sse(usage_chunk(self.request_id, self.created, self.model,
                                       _line_usage(line), chat=self.chat)))
        return out


def final_response(request_id: str, model: str, chat: bool, lines: Sequence[Mapping[str, Any]],
                   token_text: Callable[[int], str], want_logprobs: bool) -> JSONObject:
    """The whole (non-streamed) response from every line of a finished request."""
    final = lines[-1]
    text = "".join(str(line.get("text", "")) for line in lines)
    lps = [lp for line in lines for lp in _line_logprobs(line)] if want_logprobs else []
    created = int(time.time())
    reason = str(final.get("finish_reason") or "stop")
    if chat:
        return chat_response(request_id, created, model, text, reason, _line_usage(final),
                             chat_logprobs(lps, token_text) if want_logprobs else None)
    return completion_response(request_id, created, model, text, reason, _line_usage(final),
                               completion_logprobs(lps, token_text) if want_logprobs else None)
