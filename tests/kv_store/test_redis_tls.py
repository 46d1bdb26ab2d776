"""The block store over TLS (rediss://) against a real redis-server with a test CA."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from redis_servers import RedisServer, free_port, start_server

from cleave.kv_store.block_hash import chain_hashes
from cleave.kv_store.codec import BlockHeader, encode
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.kv_store.store import EncodedBlock, StoreUnavailable

ROOT = b"t" * 32


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, int,
                                                                         Path]]:
    certs = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(certs / "ca.pem"))
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    server_cert.private_key_pem.write_to_path(str(certs / "server.key"))
    server_cert.cert_chain_pems[0].write_to_path(str(certs / "server.pem"))
    tls_port = free_port()
    server = start_server(extra_args=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(certs / "server.pem"),
        "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.pem"),
        "--tls-auth-clients", "no"])
    yield server, tls_port, certs
    server.stop()


def _blocks(n: int) -> list[EncodedBlock]:
    hashes = chain_hashes(ROOT, list(range(16 * n)), 16)
    return [EncodedBlock(h, encode(BlockHeader("bfloat16", (4, 64), 16, h), os.urandom(512)))
            for h in hashes]


async def test_round_trip_over_tls(tls_server: tuple[RedisServer, int, Path]) -> None:
    _, port, certs = tls_server
    store = RedisBlockStore(KeySpace("tls", ROOT), RedisStoreConfig(
        url=f"rediss://127.0.0.1:{port}/0", tls_ca_file=str(certs / "ca.pem")))
    try:
        blocks = _blocks(5)
        assert await store.put_many(blocks) == 5
        got = await store.fetch_prefix([b.block_hash for b in blocks])
        assert [bytes(g.payload) for g in got] == [bytes(b.value)[-512:] for b in blocks]
    finally:
        await store.close()


async def test_an_untrusted_certificate_is_refused(tls_server: tuple[RedisServer, int, Path],
                                                   tmp_path: Path) -> None:
    _, port, _ = tls_server
    other = trustme.CA()
    other.cert_pem.write_to_path(str(tmp_path / "other.pem"))
    store = RedisBlockStore(KeySpace("tls", ROOT), RedisStoreConfig(
        url=f"rediss://127.0.0.1:{port}/0", tls_ca_file=str(tmp_path / "other.pem"),
        timeout_seconds=2.0))
    try:
        with pytest.raises(StoreUnavailable):
            await store.put_many(_blocks(1))
    finally:
        await store.close()
