"""TLS server names and the settings that make a store's config, against a real redis-server
whose certificate a test CA signed for ``redis.test`` only, reached at 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from redis_servers import RedisServer, free_port, start_server

from cleave.common.settings import RedisSettings
from cleave.kv_store.block_hash import chain_hashes
from cleave.kv_store.codec import BlockHeader, encode
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.kv_store.store import EncodedBlock

ROOT = b"n" * 32
NAME = "redis.test"


@pytest.fixture(scope="module")
def named_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    certs = tmp_path_factory.mktemp("tls-names")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(certs / "ca.pem"))
    leaf = ca.issue_cert(NAME)
    leaf.private_key_pem.write_to_path(str(certs / "server.key"))
    leaf.cert_chain_pems[0].write_to_path(str(certs / "server.pem"))
    port = free_port()
    server: RedisServer = start_server(extra_args=[
        "--tls-port", str(port), "--tls-cert-file", str(certs / "server.pem"),
        "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.pem"),
        "--tls-auth-clients", "no"])
    yield port, certs / "ca.pem"
    server.stop()


def _store(port: int, ca: Path, server_name: str | None) -> RedisBlockStore:
    settings = RedisSettings(redis_url=f"rediss://127.0.0.1:{port}/0",
                             redis_tls_ca_file=str(ca), redis_tls_server_name=server_name)
    return RedisBlockStore(KeySpace("names", ROOT),
                           RedisStoreConfig.of(settings, None, timeout_seconds=2.0))


async def test_the_server_name_is_what_the_certificate_is_checked_against(
        named_tls: tuple[int, Path]) -> None:
    port, ca = named_tls
    store = _store(port, ca, NAME)
    try:
        hashes = chain_hashes(ROOT, list(range(32)), 16)
        blocks = [EncodedBlock(h, encode(BlockHeader("bfloat16", (4, 64), 16, h),
                                         os.urandom(512))) for h in hashes]
        assert await store.problem() is None
        assert await store.put_many(blocks) == 2
        assert len(await store.fetch_prefix(hashes)) == 2
    finally:
        await store.close()


async def test_without_the_server_name_the_hosts_address_does_not_match(
        named_tls: tuple[int, Path]) -> None:
    port, ca = named_tls
    store = _store(port, ca, None)
    try:
        problem = await store.problem()
    finally:
        await store.close()
    assert problem is not None and "certificate verify failed" in problem, problem
    assert "127.0.0.1" in problem  # the mismatch names the address it checked


@pytest.mark.parametrize(("url", "fields", "error"), [
    ("redis://r:6379/0", {"tls_ca_file": "/ca.pem"}, "rediss://"),
    ("unix:///r.sock", {"tls_server_name": "r"}, "rediss://"),
    ("rediss://r:6379/0", {"tls_server_name": "r", "cluster": True}, "one node")])
def test_tls_settings_that_cannot_apply_are_refused(url: str, fields: dict[str, object],
                                                    error: str) -> None:
    with pytest.raises(ValueError, match=error):
        RedisStoreConfig(url=url, **fields)  # type: ignore[arg-type]
