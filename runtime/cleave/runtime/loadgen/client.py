"""A streaming client for any OpenAI-compatible ``/v1/completions`` or ``/v1/chat/completions``.

Each request is streamed with ``stream_options: {include_usage: true}`` so that the server's own
token counts end the stream; the client notes when every chunk arrives. Every failure becomes an
error class on the record (see ``record.py``) instead of an exception, and the whole request,
headers to ``[DONE]``, runs under one deadline so a stuck server cannot hang the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from cleave.runtime.loadgen import record as rec
from cleave.runtime.loadgen.record import RequestRecord
from cleave.runtime.loadgen.workload import RequestSpec

_DETAIL_CHARS = 300


class SetupError(Exception):
    """The benchmark cannot start: bad URL, server unreachable, no model."""


def api_root(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` → ``http://host:port/v1``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SetupError(f"bad --url {url!r}: expected http://HOST:PORT or https://...")
    root = url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


@dataclass(frozen=True)
class ClientConfig:
    api_root: str  # as api_root() returns it
    model: str
    chat: bool
    timeout: float  # seconds for a whole request
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float | None = None

    @property
    def endpoint_url(self) -> str:
        return self.api_root + ("/chat/completions" if self.chat else "/completions")


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_body(cfg: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": spec.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.chat:
        messages = spec.messages or (("user", spec.prompt or ""),)
        body["messages"] = [{"role": r, "content": c} for r, c in messages]
    else:
        body["prompt"] = spec.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM-style extension: the output runs to max_tokens
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    return body


async def list_models(session: aiohttp.ClientSession, root: str, api_key: str | None,
                      timeout: float = 30.0) -> list[str]:
    try:
        async with asyncio.timeout(timeout), \
                session.get(root + "/models", headers=headers(api_key)) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise SetupError(f"GET {root}/models answered {resp.status}: "
                                 f"{text[:_DETAIL_CHARS]}")
            data = json.loads(text).get("data", [])
            return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise SetupError(f"cannot reach {root}/models: {type(e).__name__}: {e}") from None
    except (ValueError, AttributeError) as e:
        raise SetupError(f"GET {root}/models did not answer an OpenAI model list: {e}") from None


class _Failed(Exception):
    def __init__(self, error: str, detail: str) -> None:
        super().__init__(detail)
        self.error = error


class _Stream:
    """Accumulates what the chunks of one response say."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.chunk_times: list[float] = []
        self.finished_at: float | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False

    def event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError as e:
            raise _Failed(rec.MALFORMED, f"a chunk is not JSON ({e.msg}): {data[:100]!r}"
                          ) from None
        if not isinstance(obj, dict):
            raise _Failed(rec.MALFORMED, f"a chunk is not a JSON object: {data[:100]!r}")
        if "error" in obj:
            raise _Failed(rec.STREAM_ERROR, json.dumps(obj["error"])[:_DETAIL_CHARS])
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                raise _Failed(rec.MALFORMED, f"a choice is not an object: {data[:100]!r}")
            delta = choice.get("delta") or {}
            text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else "")
            if text:
                self.chunk_times.append(now - self.sent)
            if choice.get("finish_reason") and self.finished_at is None:
                self.finished_at = now - self.sent
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]


async def _read_sse(resp: aiohttp.ClientResponse, stream: _Stream) -> None:
    data: list[str] = []
    async for raw in resp.content:
        now = time.perf_counter()
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise _Failed(rec.MALFORMED, "the stream is not UTF-8") from None
        if line:
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
            continue  # comments (":...") and other fields (event:, id:) carry nothing we use
        if data:
            stream.event("\n".join(data), now)
            data = []
            if stream.done:
                return
    if data:
        stream.event("\n".join(data), time.perf_counter())
    if not stream.done:
        raise _Failed(rec.MALFORMED, "the stream ended without `data: [DONE]`")


def _count(usage: dict[str, Any] | None, key: str) -> int | None:
    value = (usage or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def send(session: aiohttp.ClientSession, cfg: ClientConfig, spec: RequestSpec,
               bench_start: float) -> RequestRecord:
    """Send one request and measure it; never raises except on cancellation."""
    sent = time.perf_counter()
    stream = _Stream(sent)
    error: str | None = None
    detail = ""
    try:
        async with asyncio.timeout(cfg.timeout):
            async with session.post(cfg.endpoint_url, json=request_body(cfg, spec),
                                    headers=headers(cfg.api_key)) as resp:
                if resp.status != 200:
                    body = await resp.text(errors="replace")
                    raise _Failed(rec.http_error(resp.status), body[:_DETAIL_CHARS])
                ctype = resp.headers.get("Content-Type", "")
                if not ctype.startswith("text/event-stream"):
                    raise _Failed(rec.MALFORMED, f"expected text/event-stream, got {ctype!r}")
                await _read_sse(resp, stream)
    except _Failed as e:
        error, detail = e.error, str(e)
    except TimeoutError:
        error, detail = rec.TIMEOUT, f"no complete answer within {cfg.timeout:g} s"
    except ValueError as e:  # aiohttp: a line longer than its buffer
        error, detail = rec.MALFORMED, str(e)[:_DETAIL_CHARS]
    except (aiohttp.ClientError, OSError) as e:
        error, detail = rec.CONNECTION, f"{type(e).__name__}: {e}"[:_DETAIL_CHARS]
    e2e = time.perf_counter() - sent
    chunks = tuple(stream.chunk_times)
    # A response with no text at all (e.g. an immediate stop) still has a first "token".
    ttft = chunks[0] if chunks else stream.finished_at
    output_tokens = _count(stream.usage, "completion_tokens")
    return RequestRecord(
        index=spec.index, start=sent - bench_start, e2e=e2e, ttft=ttft, chunk_times=chunks,
        prompt_tokens=_count(stream.usage, "prompt_tokens"),
        output_tokens=output_tokens if output_tokens is not None else len(chunks),
        usage_reported=output_tokens is not None, error=error, error_detail=detail)
