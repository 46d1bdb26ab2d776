"""Just enough HTTP/1.1 for the API proxy: message heads, and bodies copied as they come.

The proxy reads each request on a client connection (request line and headers), decides,
then forwards the head's bytes unchanged and copies the body (by ``Content-Length`` or
chunk by chunk, trailers included) to the upstream, leaving the connection positioned at
the next request (keep-alive). Responses are framed the same way, only to know where each
ends (so that a 403 goes back in its turn); their bytes are copied unchanged, each chunk of
a watch stream as soon as it arrives.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

MAX_HEAD = 64 * 1024  # the asyncio StreamReader's default limit: a longer head is refused
COPY = 65536


class BadRequest(Exception):
    """A malformed message: answered with 400 (431, 502), then the connection is closed."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Message:
    headers: dict[str, str]  # lower-cased names; a repeated header keeps its first value
    head: bytes  # as received, forwarded unchanged
    version: str

    def header(self, name: str) -> str:
        return self.headers.get(name.lower(), "")

    def _tokens(self, name: str) -> set[str]:
        return {t.strip().lower() for t in self.header(name).split(",")}

    @property
    def chunked(self) -> bool:
        return "chunked" in self._tokens("transfer-encoding")

    @property
    def framed(self) -> bool:
        """The body's end is known without closing the connection."""
        return self.chunked or bool(self.header("content-length"))

    @property
    def length(self) -> int:
        try:
            length = int(self.header("content-length") or 0)
        except ValueError:
            raise BadRequest("invalid Content-Length") from None
        if length < 0:
            raise BadRequest("invalid Content-Length")
        return length

    @property
    def keep_alive(self) -> bool:
        tokens = self._tokens("connection")
        return "close" not in tokens and (self.version != "HTTP/1.0" or "keep-alive" in tokens)


@dataclass
class Request(Message):
    method: str
    target: str  # origin-form: /path?query

    @property
    def upgrade(self) -> bool:
        return "upgrade" in self._tokens("connection") and bool(self.header("upgrade"))

    @property
    def expects_continue(self) -> bool:
        return self.header("expect").lower() == "100-continue"


@dataclass
class Response(Message):
    code: int

    def has_body(self, method: str) -> bool:
        return method != "HEAD" and self.code not in (204, 304) and self.code >= 200


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, list[str]] | None:
    """A message head (start line + headers) and its lines; None at a clean EOF. Empty lines
    before the start line are skipped, as RFC 9112 allows."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if e.partial.strip():
                raise BadRequest("incomplete message head") from None
            return None
        except asyncio.LimitOverrunError:
            raise BadRequest("message head too large", 431) from None
        head = head.lstrip(b"\r\n")
        if head.strip():
            return head, head[:-4].decode("latin-1").split("\r\n")


def _headers(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(f"malformed header line {line[:100]!r}")
        headers.setdefault(name.lower(), value.strip())
    return headers


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request's head; None at a clean end of the connection."""
    if (found := await _read_head(reader)) is None:
        return None
    head, lines = found
    try:
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest(f"malformed request line {lines[0][:100]!r}") from None
    if not version.startswith("HTTP/1.") or not target.startswith("/"):
        raise BadRequest(f"unsupported request line {lines[0][:100]!r}")
    return Request(_headers(lines[1:]), head, version, method, target)


async def read_response(reader: asyncio.StreamReader) -> Response | None:
    """The next response's head (an interim 1xx one too); None if the upstream closed."""
    if (found := await _read_head(reader)) is None:
        return None
    head, lines = found
    version, _, rest = lines[0].partition(" ")
    try:
        code = int(rest[:3])
    except ValueError:
        raise BadRequest(f"malformed status line {lines[0][:100]!r}", 502) from None
    return Response(_headers(lines[1:]), head, version, code)


async def copy_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                    message: Message) -> None:
    """Copy a message's body to ``writer`` as received (``None``: read and drop it); each
    chunk is written as it comes, so that a watch stream flows."""
    if message.chunked:
        while True:
            line = await reader.readuntil(b"\r\n")
            _write(writer, line)
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                raise BadRequest("malformed chunk size") from None
            if size == 0:
                while (line := await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    _write(writer, line)
                _write(writer, line)
                break
            await _copy(reader, writer, size + 2)  # the chunk and its CRLF
    else:
        await _copy(reader, writer, message.length)
    if writer is not None:
        await writer.drain()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, COPY))
        if not data:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(data)
        _write(writer, data)
        if writer is not None:
            await writer.drain()


def _write(writer: asyncio.StreamWriter | None, data: bytes) -> None:
    if writer is not None:
        writer.write(data)


def response(code: int, body: Any, keep_alive: bool, head_only: bool = False) -> bytes:
    """A complete JSON response, as the apiserver sends its ``Status`` errors."""
    payload = json.dumps(body).encode()
    lines = [f"HTTP/1.1 {code} {HTTPStatus(code).phrase}", "Content-Type: application/json",
             "Cache-Control: no-cache, private", "X-Content-Type-Options: nosniff",
             f"Content-Length: {len(payload)}",
             "Connection: keep-alive" if keep_alive else "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head_only else payload)
