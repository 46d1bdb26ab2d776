"""Engine + block store: the prefill/decode handoff and the shared prefix cache."""

from __future__ import annotations

import random

import pytest

from cleave.common import metric_names as names
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.store import MemoryBlockStore, StoreUnavailable
from cleave.runtime.engine.async_engine import AsyncEngine
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.kv_connector import KVStoreConnector

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture
def engines(tiny_engine_factory):  # type: ignore[no-untyped-def]
    made = [AsyncEngine(tiny_engine_factory()) for _ in range(3)]
    yield made
    for e in made:
        e.shutdown()


async def _decode_all(connector: KVStoreConnector, prompt: list[int], first: int) -> list[int]:
    tokens = [first]
    async for out in connector.decode(prompt, GREEDY, first):
        tokens += out.new_token_ids
    return tokens


async def test_prefill_then_decode_through_the_store(engines) -> None:  # type: ignore[no-untyped-def]
    single, prefill_engine, decode_engine = engines
    store = MemoryBlockStore(KeySpace("svc", prefill_engine.engine.root_hash))
    prefill = KVStoreConnector(prefill_engine, store)
    decode = KVStoreConnector(decode_engine, store)
    prompt = _prompt(75, seed=1)
    want = single.engine.generate([prompt], GREEDY)[0].token_ids

    out = await prefill.prefill(prompt, GREEDY)
    assert out.handoff is not None and out.handoff.first_token == want[0]
    assert len(store.values) == 75 // 16  # every full block, one key each
    before = decode_engine.engine.stats.prompt_tokens_computed
    assert await _decode_all(decode, prompt, out.handoff.first_token) == want
    # The decode engine computed only the tail past the last full block it loaded.
    assert decode_engine.engine.stats.prompt_tokens_computed - before == 75 - 64


async def test_second_prefill_reuses_the_shared_prefix(engines) -> None:  # type: ignore[no-untyped-def]
    _, first_engine, second_engine = engines
    store = MemoryBlockStore(KeySpace("svc", first_engine.engine.root_hash))
    system = _prompt(96, seed=2)
    a, b = [*system, 7, 8, 9], [*system, 10, 11]
    await KVStoreConnector(first_engine, store).prefill(a, GREEDY)
    before = second_engine.engine.stats.prompt_tokens_computed
    out = await KVStoreConnector(second_engine, store).prefill(b, GREEDY)
    assert second_engine.engine.stats.prompt_tokens_computed - before == 2  # only the suffix
    assert out.num_cached_tokens == 0  # nothing came from its own local cache
    # Its result equals a cold run on a fresh engine.
    cold = engines[0].engine.generate([b], SamplingParams(max_tokens=1))[0].token_ids
    assert out.handoff is not None and [out.handoff.first_token] == cold


async def test_corrupt_blocks_are_recomputed(engines) -> None:  # type: ignore[no-untyped-def]
    single, prefill_engine, decode_engine = engines
    store = MemoryBlockStore(KeySpace("svc", prefill_engine.engine.root_hash))
    prompt = _prompt(64, seed=3)
    want = single.engine.generate([prompt], GREEDY)[0].token_ids
    out = await KVStoreConnector(prefill_engine, store).prefill(prompt, GREEDY)
    assert out.handoff is not None
    second_key = store.keys.block_key(out.handoff.block_hashes[1])
    value = bytearray(store.values[second_key])
    value[-5] ^= 0xFF
    store.values[second_key] = bytes(value)
    before = decode_engine.engine.stats.prompt_tokens_computed
    got = await _decode_all(KVStoreConnector(decode_engine, store), prompt,
                            out.handoff.first_token)
    assert got == want
    assert store.corrupt_blocks == 1
    assert decode_engine.engine.stats.prompt_tokens_computed - before == 64 - 16


class _DownStore(MemoryBlockStore):
    async def fetch_prefix_as(self, hashes, finish):  # type: ignore[no-untyped-def]
        raise StoreUnavailable("down")

    async def put_many(self, blocks):  # type: ignore[no-untyped-def]
        raise StoreUnavailable("down")


async def test_a_dead_store_means_recompute_not_failure(engines) -> None:  # type: ignore[no-untyped-def]
    single, prefill_engine, decode_engine = engines
    store = _DownStore(KeySpace("svc", prefill_engine.engine.root_hash))
    prompt = _prompt(40, seed=4)
    want = single.engine.generate([prompt], GREEDY)[0].token_ids
    out = await KVStoreConnector(prefill_engine, store).prefill(prompt, GREEDY)
    assert out.handoff is not None and out.handoff.first_token == want[0]
    got = await _decode_all(KVStoreConnector(decode_engine, store), prompt,
                            out.handoff.first_token)
    assert got == want


def _metric(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name) or 0.0


async def test_two_engines_share_kv_through_a_real_redis(engines) -> None:  # type: ignore[no-untyped-def]
    from redis_servers import start_server

    from cleave.kv_store.redis_config import RedisStoreConfig
    from cleave.kv_store.redis_store import RedisBlockStore

    single, prefill_engine, decode_engine = engines
    server = start_server()
    keys = KeySpace("svc-real", prefill_engine.engine.root_hash)
    stores = [RedisBlockStore(keys, RedisStoreConfig(url=url, timeout_seconds=1.0))
              for url in (server.unix_url, server.url)]  # prefill over unix, decode over TCP
    try:
        system = _prompt(80, seed=6)
        a, b = [*system, 1, 2, 3], [*system, 4, 5, 6, 7]
        await KVStoreConnector(prefill_engine, stores[0]).prefill(a, GREEDY)
        # A second engine prefills b: only what follows the shared 80 tokens is computed.
        before = decode_engine.engine.stats.prompt_tokens_computed
        out = await KVStoreConnector(decode_engine, stores[1]).prefill(b, GREEDY)
        assert decode_engine.engine.stats.prompt_tokens_computed - before == len(b) - 80
        assert out.handoff is not None
        want = single.engine.generate([b], GREEDY)[0].token_ids
        assert out.handoff.first_token == want[0]
        # Decode b in the prefill engine from the blocks the other engine saved.
        fallbacks = _metric(names.total(names.KV_RECOMPUTE_FALLBACKS))
        got = await _decode_all(KVStoreConnector(prefill_engine, stores[0]), b,
                                out.handoff.first_token)
        assert got == want
        assert _metric(names.total(names.KV_RECOMPUTE_FALLBACKS)) == fallbacks

        # Redis dies: the next request still completes, by recomputing, and says so.
        server.kill()
        c = [*system, 9, 9]
        want_c = single.engine.generate([c], GREEDY)[0].token_ids
        got_c = await _decode_all(KVStoreConnector(prefill_engine, stores[0]), c, want_c[0])
        assert got_c == want_c
        assert _metric(names.total(names.KV_RECOMPUTE_FALLBACKS)) == fallbacks + 1
    finally:
        for s in stores:
            await s.close()
        server.stop()


def test_store_warnings_are_throttled_and_count_what_they_muted(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from cleave.runtime import kv_connector

    clock = [100.0]
    monkeypatch.setattr(kv_connector.time, "monotonic", lambda: clock[0])
    throttle = kv_connector.ThrottledWarning(logging.getLogger("throttle-test"), 10.0)
    caplog.set_level("WARNING", logger="throttle-test")
    for _ in range(5):
        throttle.warn("load", "store down")
    throttle.warn("save", "store down")  # another kind has its own allowance
    clock[0] = 111.0
    throttle.warn("load", "store down")
    assert [r.getMessage() for r in caplog.records] == [
        "store down", "store down", "store down (4 more like it in the last 11 s)"]
