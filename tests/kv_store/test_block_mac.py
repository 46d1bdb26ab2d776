"""KV blocks cannot be injected (issue 15): a block is sealed with a MAC keyed by the service's
KV salt, so whoever can write to Redis but lacks the salt cannot store KV of their own under
the chain hashes of a real prompt. A forged block is a miss, recomputed, never served.

Real engines on the tiny model and a real redis-server, as a worker builds its store
(commands.py: ``KeySpace(..., mac_key=mac_key(salt))``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from redis_servers import RedisServer

from cleave.kv_store.block_hash import chain_hashes
from cleave.kv_store.codec import CorruptBlock, decode, encode, mac_key
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.runtime.engine.async_engine import AsyncEngine
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.kv_connector import KVStoreConnector

PROMPT = "the engineer builds many books before dinner " * 8
SALT = "the-services-secret-salt"


@pytest.fixture
async def worker(tiny_engine_factory: Callable[..., Any], redis_server: RedisServer
                 ) -> AsyncIterator[Callable[[], KVStoreConnector]]:
    made: list[KVStoreConnector] = []

    def make() -> KVStoreConnector:
        engine = AsyncEngine(tiny_engine_factory(salt=SALT))
        keys = KeySpace("ns.svc", engine.engine.root_hash, mac_key=mac_key(SALT))
        connector = KVStoreConnector(engine, RedisBlockStore(
            keys, RedisStoreConfig(url=redis_server.url, timeout_seconds=5.0)))
        made.append(connector)
        return connector

    yield make
    for c in made:
        await c.store.close()
        c.engine.shutdown()


async def test_a_block_forged_without_the_key_is_a_miss(
        worker: Callable[[], KVStoreConnector], redis_server: RedisServer) -> None:
    prefill, decoder = worker(), worker()
    prompt = prefill.engine.engine.tokenize(PROMPT)
    params = SamplingParams(max_tokens=4)
    honest = await prefill.prefill(prompt, params)
    hashes = chain_hashes(prefill.root_hash, prompt[:-1], prefill.block_size)
    assert len((await decoder.load_prefix(prompt)).blocks) == len(hashes)  # type: ignore[union-attr]

    # The attacker reads the keys and headers (Redis access) and writes KV of their own under
    # them: a well-formed block, same header, checksummed as before, but not MACed.
    plain = redis_server.client()
    for h in hashes:
        key = prefill.store.keys.block_key(h)
        header, payload = decode(plain.get(key), expected_hash=h, key=mac_key(SALT))
        plain.set(key, encode(header, bytes(len(payload))))  # zeroed KV: steers the output
        with pytest.raises(CorruptBlock):
            decode(plain.get(key), expected_hash=h, key=mac_key(SALT))
        with pytest.raises(CorruptBlock):  # nor with a key guessed from another salt
            plain.set(key, encode(header, bytes(len(payload)), mac_key("guess")))
            decode(plain.get(key), expected_hash=h, key=mac_key(SALT))

    assert await decoder.load_prefix(prompt) is None  # every forged block: a miss
    assert await decoder.store.get_many(hashes) == [None] * len(hashes)
    # ... and the request is recomputed, the same as the honest prefill's first token.
    outs = [o async for o in decoder.decode(
        prompt, params, honest.handoff.first_token,  # type: ignore[union-attr]
        request_id="after-forgery")]
    assert outs and outs[-1].finished
    print(f"\nreliability forged_blocks_served=0 forged_blocks_written={len(hashes)}")


def test_the_mac_key_is_derived_and_empty_without_a_salt() -> None:
    assert mac_key("") == b""
    assert len(mac_key(SALT)) == 32 and mac_key(SALT) != SALT.encode()
    assert mac_key(SALT) != mac_key(SALT + "x")
    assert "mac_key" not in repr(KeySpace("svc", bytes(32), mac_key=mac_key(SALT)))
