"""How the router answers: a failure as OpenAI's error body, whatever raised it, and a
streamed response as server-sent events, whose failures after the first byte go in-band.

An exception nobody expected (a bug) is logged with its traceback and answered as a 500
``server_error``, never as aiohttp's text/plain page, which the ``openai`` client cannot read.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web

from cleave.runtime import metrics
from cleave.runtime.serving import protocol as api
from cleave.runtime.serving import responses
from cleave.runtime.serving.admission import Admission
from cleave.runtime.serving.wire import TokenLine

log = logging.getLogger("cleave.router")
RETRY_LATER: Final = (429, 503)


def failure(e: Exception, rid: str) -> api.APIError:
    """What the client is told of ``e``: itself when it is an API error; aiohttp's own (a
    404 route) in the same shape; anything else, a 500 that says nothing of its cause."""
    if isinstance(e, api.APIError):
        return e
    if isinstance(e, web.HTTPException):
        return api.APIError(e.status, e.reason or "error")
    log.error("request %s failed", rid, exc_info=e)
    return api.APIError(500, "the server failed to answer the request", "server_error")


def error_reply(e: Exception, rid: str) -> web.Response:
    err = failure(e, rid)
    headers = {"X-Request-Id": rid}
    if err.status in RETRY_LATER:
        headers["Retry-After"] = "1"
    if isinstance(e, api.APIError):
        log.info("request %s -> %d %s", rid, err.status, err.message)
    return responses.json_reply(err.reply(), err.status, headers)


async def stream(request: web.Request, events: AsyncIterator[tuple[int, TokenLine]],
                 writer: responses.StreamWriter, rid: str,
                 admission: Admission) -> web.StreamResponse:
    """SSE: nothing is sent until the first token, so early failures are ordinary errors. A
    choice's chunk that echoes the prompt's logprobs is built off the event loop."""
    response: web.StreamResponse | None = None
    try:
        async for index, line in events:
            if response is None:
                response = web.StreamResponse(headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                    "X-Request-Id": rid})
                await response.prepare(request)
            chunks = await admission.off_loop(writer.chunks, line, index) \
                if writer.heavy(index) else writer.chunks(line, index)
            for chunk in chunks:
                await response.write(chunk)
    except Exception as e:
        if response is None or isinstance(e, ConnectionResetError):
            raise  # before the first byte: an ordinary error; after the client left: no one
        err = failure(e, rid)
        metrics.ROUTER_ERRORS.labels(str(err.status)).inc()  # the status said 200
        await response.write(responses.sse(err.reply()))  # headers are gone: error in-band
    assert response is not None
    await response.write(responses.SSE_DONE)
    await response.write_eof()
    return response
