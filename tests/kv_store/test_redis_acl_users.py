"""The managed Redis's ACL users (operator/cleave/operator/redis_users.py), on a real
redis-server started by the operator's own container script with the pod's environment.

The worker's and the router's block stores work as their users, and Redis counts exactly the
commands each user is granted (INFO commandstats: nothing granted goes unused, nothing used is
refused); outside that, each user is refused: another service's keys, FLUSHALL, CONFIG, KEYS,
the router's reads and writes. The default user needs the admin password.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_servers import RedisServer, start_server

from cleave.kv_store.block_hash import chain_hashes
from cleave.kv_store.codec import BlockHeader, encode
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.kv_store.store import EncodedBlock
from cleave.operator import builders, redis_users
from cleave.operator.redis_users import RedisPasswords
from cleave.operator.spec import LLMServiceSpec, parse_spec

ROOT = b"r" * 32
PASSWORDS = RedisPasswords("admin-pw-1", "worker-pw-2", "router-pw-3")
SERVICE = {"apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
           "metadata": {"name": "chat", "namespace": "ml", "uid": "u1"},
           "spec": {"model": {"name": "m", "source": "m"}, "decode": {"replicas": 1},
                    "kvStore": {"managed": {"memory": "256Mi"}}}}


@pytest.fixture(scope="module")
def spec() -> LLMServiceSpec:
    return parse_spec(SERVICE)


@pytest.fixture(scope="module")
def pod_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("redis-pod-tmp")


@pytest.fixture(scope="module")
def server(spec: LLMServiceSpec, pod_tmp: Path) -> Iterator[RedisServer]:
    """redis-server as the StatefulSet runs it: its command, its env from the Secret."""
    children = builders.managed_redis(spec, builders.owner_reference(SERVICE), PASSWORDS)
    [statefulset] = [c for c in children if c["kind"] == "StatefulSet"]
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    data = PASSWORDS.as_data()
    env = {e["name"]: data[e["valueFrom"]["secretKeyRef"]["key"]] for e in container["env"]}
    env.update(PATH=os.environ["PATH"], TMPDIR=str(pod_tmp))
    # "redis-server" is the script's $0; start_server's arguments follow as "$@".
    srv = start_server(password=PASSWORDS.admin, command=[*container["command"], "redis-server"],
                       env=env)
    yield srv
    srv.stop()


def _url(spec: LLMServiceSpec, component: str, server: RedisServer, transport: str) -> str:
    """The component's URL as the operator builds it, pointed at the test's server."""
    url = builders.redis_url(spec, component)
    user = url.split("//")[1].split("@")[0]
    if transport == "unix":
        return f"unix://{user}@{server.unixsocket}?db=0"
    return f"redis://{user}@127.0.0.1:{server.port}/0"


def _store(spec: LLMServiceSpec, server: RedisServer, component: str, password: str,
           transport: str = "tcp", namespace: str | None = None) -> RedisBlockStore:
    keys = KeySpace(namespace or builders.kv_namespace(spec), ROOT, mac_key=b"k" * 32)
    return RedisBlockStore(keys, RedisStoreConfig(
        url=_url(spec, component, server, transport), password=password, timeout_seconds=2.0))


def _blocks(n: int, salt: int = 0) -> list[EncodedBlock]:
    hashes = chain_hashes(ROOT, [salt, *range(16 * n - 1)], 16)
    return [EncodedBlock(h, encode(BlockHeader("bfloat16", (4, 64), 16, h), os.urandom(512),
                                   key=b"k" * 32)) for h in hashes]


# The handshake (AUTH, or HELLO with AUTH: Redis lets every user run them) and the admin's own.
_UNGRANTED = ("auth", "hello", "info", "config|resetstat")


def _commands_counted(admin: redis.Redis) -> dict[str, dict[str, Any]]:
    stats: dict[str, dict[str, Any]] = admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): s for name, s in stats.items()
            if name.removeprefix("cmdstat_") not in _UNGRANTED}


def _as(server: RedisServer, user: str, password: str) -> redis.Redis:
    return server.client(username=user, password=password)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_the_stores_send_exactly_the_commands_their_users_are_granted(
        spec: LLMServiceSpec, server: RedisServer, transport: str) -> None:
    admin = server.client()
    admin.config_resetstat()
    worker = _store(spec, server, "decode", PASSWORDS.worker, transport)
    router = _store(spec, server, "router", PASSWORDS.router, transport)
    try:
        blocks = _blocks(4, salt=1 if transport == "tcp" else 2)
        assert await worker.problem() is None  # /ready's PING
        assert await worker.put_many(blocks) == 4
        hashes = [b.block_hash for b in blocks]
        assert len(await worker.fetch_prefix(hashes)) == 4  # sizes unknown: STRLEN, GETEX
        assert len(await worker.fetch_prefix(hashes)) == 4  # sizes known: GETEX alone
        assert await worker.longest_cached_prefix(hashes) == 4
        worker_counts = _commands_counted(admin)
        admin.config_resetstat()
        assert await router.longest_cached_prefix(hashes) == 4
        router_counts = _commands_counted(admin)
    finally:
        await worker.close()
        await router.close()
        admin.close()
    for counts, granted in ((worker_counts, redis_users.WORKER_COMMANDS),
                            (router_counts, redis_users.ROUTER_COMMANDS)):
        assert set(counts) == set(granted), counts  # used == granted, both ways
        assert all(s.get("rejected_calls", 0) == 0 and s.get("failed_calls", 0) == 0
                   for s in counts.values()), counts


def test_a_worker_reaches_only_its_own_services_keys_and_no_admin_command(
        spec: LLMServiceSpec, server: RedisServer) -> None:
    mine = f"cleave:v1:{builders.kv_namespace(spec)}:00:ab"
    theirs = "cleave:v1:ml.other:00:ab"
    client = _as(server, redis_users.WORKER_USER, PASSWORDS.worker)
    try:
        assert client.set(mine, b"x", ex=60) is True
        assert client.getex(mine, ex=60) == b"x" and client.strlen(mine) == 1
        for refused in (lambda: client.set(theirs, b"x", ex=60), lambda: client.getex(theirs),
                        lambda: client.strlen(theirs), lambda: client.get(mine),
                        lambda: client.delete(mine), client.flushall, client.flushdb,
                        lambda: client.config_get("*"), lambda: client.keys("*"),
                        lambda: client.scan(), lambda: client.execute_command("SELECT", 1),
                        lambda: client.execute_command("ACL", "LIST"), client.dbsize):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    finally:
        client.close()


def test_the_router_may_only_measure_its_services_keys(spec: LLMServiceSpec,
                                                       server: RedisServer) -> None:
    mine = f"cleave:v1:{builders.kv_namespace(spec)}:00:cd"
    admin = server.client()
    admin.set(mine, b"value")
    client = _as(server, redis_users.ROUTER_USER, PASSWORDS.router)
    try:
        assert client.strlen(mine) == 5
        for refused in (lambda: client.get(mine), lambda: client.getex(mine, ex=5),
                        lambda: client.set(mine, b"forged"), client.ping,
                        lambda: client.strlen("cleave:v1:ml.other:00:cd"), client.flushall):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
        assert admin.get(mine) == b"value"
    finally:
        client.close()
        admin.close()


def test_no_password_opens_it_and_each_password_opens_its_own_user_only(
        server: RedisServer) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5.0)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()
    finally:
        anonymous.close()
    for user, password in ((redis_users.WORKER_USER, PASSWORDS.router),
                           (redis_users.ROUTER_USER, PASSWORDS.worker),
                           ("default", PASSWORDS.worker)):
        client = _as(server, user, password)
        try:
            with pytest.raises(redis.exceptions.AuthenticationError):
                client.ping()
        finally:
            client.close()


def test_the_acl_file_stays_private_to_the_redis_pod(server: RedisServer, pod_tmp: Path,
                                                     ) -> None:
    acl = pod_tmp / "users.acl"
    assert acl.stat().st_mode & 0o077 == 0  # umask 077: the passwords are in it
    assert PASSWORDS.worker in acl.read_text()
