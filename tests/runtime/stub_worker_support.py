"""A stub decode worker for in-process router tests: its stats say idle; ``generate`` is the
test's own handler for ``/internal/generate``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def stub_worker_app(generate: Handler) -> web.Application:
    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"kv_usage": 0.0, "waiting": 0, "draining": False})

    app = web.Application()
    app.router.add_get("/internal/stats", stats)
    app.router.add_post("/internal/generate", generate)
    return app
