"""The in-cluster API endpoint: TLS on the bridge address, RBAC, then the emulator's HTTP.

``kubernetes.config.load_incluster_config()`` (and kopf's in-cluster login) insist on https
with the service account's ``ca.crt``; the emulator serves plain HTTP on 127.0.0.1, which pods
cannot reach from their network namespaces anyway. This proxy terminates TLS with a
``trustme`` CA and, as the apiserver would, authenticates and authorizes every request:

- each HTTP/1.1 request on a connection is parsed (``http1``: head, body by Content-Length
  or chunks, keep-alive); its ``Authorization: Bearer`` token names a ServiceAccount
  (:class:`Tokens`); no token is ``system:anonymous``, an unknown one gets 401;
- the RBAC authorizer (``rbac``) decides on the ClusterRoles, Roles and bindings listed from
  the emulator (re-listed when older than ``policy_ttl``); a denial gets the apiserver's 403
  ``Status`` and never reaches the emulator;
- an allowed request goes upstream unchanged (one upstream connection per client
  connection); responses are copied back unchanged, each chunk of a watch stream as it
  comes, and framed only to keep them in the order of the requests (pipelining works).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import secrets
import ssl
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import trustme

from . import http1, rbac

NAMES = ("kubernetes", "kubernetes.default", "kubernetes.default.svc",
         "kubernetes.default.svc.cluster.local")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
ERRORS = (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)


class Tokens:
    """ServiceAccount tokens -> (namespace, name): the node's token map.

    :meth:`mint` makes a random token for a ServiceAccount (the node mounts one in each pod
    that automounts its token); :meth:`identify` knows only minted tokens, so a pod cannot
    forge another account's."""

    def __init__(self) -> None:
        self._by_token: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def mint(self, namespace: str, name: str) -> str:
        token = f"localnode-{secrets.token_urlsafe(24)}"
        with self._lock:
            self._by_token[token] = (namespace, name)
        return token

    def identify(self, token: str) -> tuple[str, str] | None:
        with self._lock:
            if found := self._by_token.get(token):
                return found
        return None


class PolicyCache:
    """The RBAC objects, listed from the emulator's API when older than ``ttl`` seconds."""

    PLURALS = ("clusterroles", "roles", "clusterrolebindings", "rolebindings")

    def __init__(self, url: str, ttl: float = 1.0) -> None:
        self.url, self.ttl = url.rstrip("/"), ttl
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._policy, self._at = rbac.Policy(), -float("inf")
        self._lock = asyncio.Lock()

    def fetch(self) -> rbac.Policy:
        lists = []
        for plural in self.PLURALS:
            url = f"{self.url}/apis/{rbac.RBAC_GROUP}/v1/{plural}"
            with self._opener.open(url, timeout=10) as r:
                lists.append(json.loads(r.read())["items"])
        return rbac.Policy(*lists)

    async def get(self) -> rbac.Policy:
        async with self._lock:
            if time.monotonic() - self._at > self.ttl:
                self._policy = await asyncio.to_thread(self.fetch)
                self._at = time.monotonic()
            return self._policy


class ApiProxy:
    """Serves ``https://<host>:<port>`` for pods, forwarding to ``upstream`` (host, port).
    ``port`` 0 picks a free one (``self.port`` after :meth:`start`)."""

    def __init__(self, host: str, port: int, upstream: tuple[str, int], tls_dir: Path,
                 policy_ttl: float = 1.0) -> None:
        self.host, self.port, self.upstream = host, port, upstream
        ca = trustme.CA()
        self.ca_path = tls_dir / "ca.crt"
        ca.cert_pem.write_to_path(str(self.ca_path))
        self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ctx.set_alpn_protocols(["http/1.1"])  # no HTTP/2 (Go clients would try it)
        ca.issue_cert(host, *NAMES).configure_cert(self._ctx)
        self.tokens = Tokens()
        self.policy = PolicyCache(f"http://{upstream[0]}:{upstream[1]}", policy_ttl)
        # The latest denials, "<user> <verb> <path>: <message>": for dumps and tests.
        self.denied: collections.deque[str] = collections.deque(maxlen=100)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="localnode-apiproxy")
        self._server: asyncio.Server | None = None

    def start(self) -> None:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(asyncio.start_server(
            self._serve, self.host, self.port, ssl=self._ctx), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        queue: asyncio.Queue[Pending | bytes | None] = asyncio.Queue()
        requests = asyncio.ensure_future(self._requests(reader, up_writer, queue))
        responses = asyncio.ensure_future(_responses(up_reader, writer, queue))
        try:
            await asyncio.wait([requests, responses], return_when=asyncio.FIRST_COMPLETED)
            if requests.done() and not requests.cancelled() and requests.result():
                await responses  # the answers queued before the connection closes
        except asyncio.CancelledError:
            pass  # stop(): a normal end (3.11's start_server callback chokes on a cancel)
        finally:
            for task in (requests, responses):
                task.cancel()
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()

    async def _requests(self, reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter,
                        queue: asyncio.Queue[Pending | bytes | None]) -> bool:
        """Read, authorize and forward (or answer) the connection's requests in turn; each
        leaves in the queue what its response will be (upstream's, or the bytes of ours).
        True: close once the queued responses are written; False: the client is gone."""
        with contextlib.suppress(*ERRORS):
            try:
                while (request := await http1.read_request(reader)) is not None:
                    answer = await self._check(request)
                    if answer is None:
                        switched = asyncio.get_running_loop().create_future() \
                            if request.upgrade else None
                        if request.expects_continue:  # as the apiserver would (the
                            queue.put_nowait(CONTINUE)  # emulator does not)
                        queue.put_nowait(Pending(request.method, switched))
                        up_writer.write(request.head)
                        await http1.copy_body(reader, up_writer, request)
                        if switched is not None and await switched:
                            await _pipe(reader, up_writer)  # another protocol: bytes as is
                            return False
                        continue
                    code, body = answer
                    # A client waiting for "100 Continue" might never send the body.
                    keep = request.keep_alive and not request.expects_continue
                    if keep:
                        await http1.copy_body(reader, None, request)
                    queue.put_nowait(http1.response(code, body, keep, request.method == "HEAD"))
                    if not keep:
                        queue.put_nowait(None)
                        return True
            except http1.BadRequest as e:
                status = rbac.status(e.code, "BadRequest", str(e))
                queue.put_nowait(http1.response(e.code, status, keep_alive=False))
                queue.put_nowait(None)
                return True
        return False

    async def _check(self, request: http1.Request) -> tuple[int, rbac.Obj] | None:
        """None if the request may go upstream, else the error response (code, Status)."""
        scheme, _, token = request.header("authorization").partition(" ")
        if not scheme:
            user = rbac.User(rbac.ANONYMOUS, (rbac.UNAUTHENTICATED,))
        elif scheme.lower() != "bearer" or (found := self.tokens.identify(token.strip())) is None:
            return 401, rbac.status(401, "Unauthorized", "Unauthorized")
        else:
            user = rbac.User.service_account(*found)
        attributes = rbac.request_attributes(request.method, request.target, user)
        try:
            policy = await self.policy.get()
        except (OSError, ValueError, KeyError) as e:
            return 500, rbac.status(500, "InternalError", f"RBAC: cannot list the policy: {e}")
        decision = rbac.authorize(policy, attributes)
        if decision.allowed:
            return None
        body = rbac.forbidden(attributes, decision)
        self.denied.append(f"{user.name} {request.method} {request.target}: {body['message']}")
        return 403, body


@dataclass
class Pending:
    """A request sent upstream: its response comes next from there."""
    method: str
    upgrade: asyncio.Future[bool] | None = None  # for an Upgrade request: switched or not


async def _responses(up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     queue: asyncio.Queue[Pending | bytes | None]) -> None:
    """Write the responses in the order of the requests: the upstream's (copied as they
    come, each chunk of a watch at once) or the proxy's own; end at None."""
    with contextlib.suppress(*ERRORS, http1.BadRequest):
        while (item := await queue.get()) is not None:
            if isinstance(item, bytes):
                writer.write(item)
                await writer.drain()
                continue
            while (response := await http1.read_response(up_reader)) is not None:
                writer.write(response.head)
                if response.code >= 200 or response.code == 101:
                    break
                await writer.drain()  # 100 Continue: the final response follows
            if response is None:
                return
            if item.upgrade is not None:
                item.upgrade.set_result(response.code == 101)
            if response.code == 101:
                await _pipe(up_reader, writer)
                return
            if not response.has_body(item.method):
                await writer.drain()
            elif response.framed:
                await http1.copy_body(up_reader, writer, response)
            else:  # the body ends when the upstream closes
                await _pipe(up_reader, writer)
                return
            if not response.keep_alive:
                return


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(*ERRORS):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
