"""The key of the workers' internal API: every ``/internal/*`` call carries the service's token.

A worker's port is reachable by whatever the network lets through (a NetworkPolicy narrows it
to the router and the operator; a cluster without a policy engine lets every pod in). The
token is what keeps a pod that can reach the port from skipping the router's API key, its
limits and its validation. Probes (/health, /ready) and scrapes (/metrics) stay open: kubelets
and Prometheus hold no token, and those paths neither compute nor reveal anything private.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

# Everything else needs the token: an allow-list, so that a path spelled oddly
# ("//internal/stats", a route added later) is never open by accident.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def bearer(token: str) -> dict[str, str]:
    """The header a caller of ``/internal/*`` sends."""
    return {"Authorization": f"Bearer {token}"}


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries ``token``, compared in constant time (a byte
    compare that stops early would tell an attacker how many leading bytes are right)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


def require_token(token: str | None) -> Middleware:
    """Middleware refusing every path but OPEN_PATHS without ``token`` (401). ``None``: no
    token is configured, the API is open (a worker on loopback, in tests and local runs)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None and request.path not in OPEN_PATHS \
                and not authorized(request.headers.get("Authorization"), token):
            return web.json_response(
                {"error": {"message": "the internal API needs the service's token",
                           "type": "authentication_error"}},
                status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return middleware
