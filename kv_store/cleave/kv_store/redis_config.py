"""How the block store reaches Redis: its settings, and the redis-py client they make.

The password can come in the URL or on its own; either way it never reaches a log line or a
repr.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.connection import parse_url as parse_async_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import parse_url

from cleave.common.settings import RedisSettings


@dataclass(frozen=True)
class RedisStoreConfig:
    url: str = "redis://127.0.0.1:6379/0"  # redis://, rediss:// (TLS) or unix:///path.sock
    password: str | None = None  # overrides one in the URL; never logged
    username: str | None = None
    cluster: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    tls_server_name: str | None = None  # the certificate's name (and SNI), if not the host's
    ttl_seconds: int = 3600
    timeout_seconds: float = 2.0  # per call: lookups, a whole put_many, a whole get_many
    connect_timeout_seconds: float = 1.0
    # The redis-py path (Redis Cluster, TLS): pipelines of at most this many commands and
    # value bytes, ``connections`` of them in flight.
    pipeline_depth: int = 32
    pipeline_bytes: int = 4 << 20
    # The fast path (one node, TCP or unix socket): a transfer keeps ``connections``
    # connections busy, each with at most ``pipeline_depth`` commands and these many value
    # bytes in flight (one command always goes). Redis copies each GET reply into its reply
    # buffers, and with less of them in flight more stay in cache: with 360 KiB blocks, one
    # GET in flight per connection read 5-10 % faster than two or more. Puts differ by
    # transport: over a unix socket up to five 360 KiB SETs in flight wrote 40 % faster than
    # one, over loopback TCP one wrote 35 % faster than five. None: 2 MiB over a unix
    # socket, 512 KiB over TCP.
    connections: int = 4
    put_bytes_in_flight: int | None = None
    get_bytes_in_flight: int = 512 << 10
    # Send large values over a unix socket by splicing their pages into it instead of
    # copying them (Linux; see splice.py). Off, or over TCP, values are copied.
    splice_sends: bool = True
    # Values are ~64 KiB-1 MiB: reading the socket in 1 MiB gulps instead of redis-py's
    # 64 KiB default cuts event-loop round trips per value.
    socket_read_size: int = 1 << 20
    # Memory kept for reuse by reads once their blocks are loaded (see buffers.py).
    read_buffer_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"the Redis URL must start with redis://, rediss:// or unix://, "
                             f"got {scheme or 'no scheme'}:")
        if self.ttl_seconds < 1 or self.timeout_seconds <= 0:
            raise ValueError("ttl_seconds and timeout_seconds must be positive")
        if min(self.pipeline_depth, self.pipeline_bytes, self.connections,
               self.put_bytes, self.get_bytes_in_flight) < 1:
            raise ValueError("pipeline_depth, pipeline_bytes, connections and the bytes in "
                             "flight must be >= 1")
        tls = (self.tls_ca_file, self.tls_server_name)
        if any(v is not None for v in tls) and scheme != "rediss":
            raise ValueError("a Redis TLS CA file or server name needs a rediss:// URL")
        if self.tls_server_name is not None and self.cluster:
            raise ValueError("a TLS server name applies to one node, not a Redis Cluster")

    @classmethod
    def of(cls, settings: RedisSettings, password: str | None, **tuning: Any,
           ) -> RedisStoreConfig:
        """The config the connection flags (``RedisSettings``) describe; the password read
        from its file or the environment by the caller; ``tuning``: any other field."""
        assert settings.redis_url is not None, "no store configured"
        return cls(url=settings.redis_url, password=password,
                   tls_ca_file=settings.redis_tls_ca_file,
                   tls_server_name=settings.redis_tls_server_name, **tuning)

    @property
    def put_bytes(self) -> int:
        """Value bytes in flight per connection for puts (see ``put_bytes_in_flight``)."""
        if self.put_bytes_in_flight is not None:
            return self.put_bytes_in_flight
        return 2 << 20 if urlsplit(self.url).scheme == "unix" else 512 << 10

    def __repr__(self) -> str:  # the password must never reach a log line
        return f"RedisStoreConfig(url={_redact(self.url)!r}, cluster={self.cluster})"


def _redact(url: str) -> str:
    """The URL with any password (user info or ``?password=``) replaced by ``***``."""
    u = urlsplit(url)
    netloc = u.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = "&".join(("password=***" if p.lower().startswith("password=") else p)
                     for p in u.query.split("&")) if u.query else ""
    return urlunsplit((u.scheme, netloc, u.path, query, u.fragment))


def _without_password(url: str) -> str:
    """Drop the URL's own password so the configured one wins (redis-py lets the URL win)."""
    u = urlsplit(url)
    netloc = u.netloc.rpartition("@")[2]
    user = u.netloc.rpartition("@")[0].partition(":")[0] if "@" in u.netloc else ""
    if user:
        netloc = f"{user}@{netloc}"
    query = "&".join(p for p in u.query.split("&") if not p.lower().startswith("password="))
    # Not urlunsplit: it drops the "//" of a URL with no host, and unix:///path needs it.
    return (f"{u.scheme}://{netloc}{u.path}" + (f"?{query}" if query else "")
            + (f"#{u.fragment}" if u.fragment else ""))


def split_password(url: str) -> tuple[str, str | None]:
    """The URL without its password (in the user info or ``?password=``), and that password
    as redis-py reads it; the user name, if any, stays."""
    password: str | None = parse_url(url).get("password")  # type: ignore[no-untyped-call]
    return (_without_password(url), password) if password is not None else (url, None)


def redis_py_client(config: RedisStoreConfig) -> Any:
    """The redis-py asyncio client for this config (cluster or single node): control commands,
    Cluster and TLS go through it."""
    options: dict[str, Any] = {
        "socket_timeout": config.timeout_seconds,
        "socket_connect_timeout": config.connect_timeout_seconds,
        "retry": Retry(NoBackoff(), 0),
        "socket_read_size": config.socket_read_size,
        # No CLIENT SETINFO on connect: an ACL user granted only the store's commands
        # (operator/cleave/operator/redis_users.py) would be refused it, in Redis's ACL log.
        "driver_info": None,
    }
    url = config.url
    if config.password is not None:
        options["password"] = config.password
        url = _without_password(url)
    if config.username is not None:
        options["username"] = config.username
    if config.url.startswith("rediss://"):
        options["ssl_ca_certs"] = config.tls_ca_file
        options["ssl_certfile"] = config.tls_cert_file
        options["ssl_keyfile"] = config.tls_key_file
        options["ssl_cert_reqs"] = "required" if config.tls_verify else "none"
    if config.cluster:
        return RedisCluster.from_url(url, **options)
    options["max_connections"] = config.connections + 2
    if config.tls_server_name is not None:
        # redis-py has no server-name option, and its URL parsing picks the connection
        # class: the pool is made from the parsed URL with ours in its place.
        kwargs = {**parse_async_url(url), **options, "connection_class": _NamedSSLConnection,
                  "server_name": config.tls_server_name}
        return aioredis.Redis(connection_pool=aioredis.ConnectionPool(**kwargs))
    return aioredis.Redis.from_url(url, **options)


class _NamedSSLConnection(SSLConnection):
    """TLS that checks the certificate against (and sends as SNI) a given name, not the
    host's: a server reached by IP, or by a Service name its certificate does not carry."""

    def __init__(self, *, server_name: str, **kwargs: Any) -> None:
        self.server_name = server_name
        super().__init__(**kwargs)

    def _connection_arguments(self) -> Mapping[str, Any]:
        return {**super()._connection_arguments(), "server_hostname": self.server_name}
