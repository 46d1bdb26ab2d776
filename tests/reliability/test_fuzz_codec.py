"""Fuzzing the KV block codec: a corrupted value is a miss, never an exception escaping.

Three levels, each with generated corruptions (bit flips, truncation, extension, a foreign
header spliced on, arbitrary bytes): the codec alone (only ``CorruptBlock``, for every
mutation); the Redis store over a real redis-server (a ``None`` in place of the block, the
prefix ends there); and a decode worker's connector on the tiny model (the prompt's remaining
blocks are recomputed and the output is exactly the uncorrupted one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from figures import report
from fuzzing import SCALE, fuzz, random_cases
from hypothesis import strategies as st
from redis_servers import RedisServer

from cleave.kv_store import metrics as store_metrics
from cleave.kv_store.block_hash import KVFingerprint, chain_hashes
from cleave.kv_store.codec import DTYPE_SIZES, BlockHeader, CorruptBlock, decode, encode
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.kv_store.store import EncodedBlock
from cleave.runtime.engine.async_engine import AsyncEngine
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.kv_connector import KVStoreConnector

FP = KVFingerprint("fuzz", "sha256:0", "float32", num_layers=1, num_kv_heads=1, head_dim=4)
HASHES = chain_hashes(FP.root_hash(), list(range(16 * 8)), 16)
PROMPT = "a robot counts three apples near the station " * 8


@st.composite
def blocks(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A valid encoded block and the hash it belongs to."""
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    block_hash = draw(st.sampled_from(HASHES))
    header = BlockHeader(dtype, shape, draw(st.integers(0, 64)), block_hash)
    payload = draw(st.binary(min_size=header.payload_len, max_size=header.payload_len))
    return encode(header, payload), block_hash


@st.composite
def corruptions(draw: st.DrawFn, value: bytes) -> bytes:
    """``value`` changed in one of the ways storage, networks or other writers change bytes."""
    kind = draw(st.sampled_from(["flip", "truncate", "extend", "splice", "random"]))
    if kind == "flip":
        data = bytearray(value)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        out = bytes(data)
    elif kind == "truncate":
        out = value[:draw(st.integers(0, len(value) - 1))]
    elif kind == "extend":
        out = value + draw(st.binary(min_size=1, max_size=64))
    elif kind == "splice":  # another block's header on this payload
        other, _ = draw(blocks())
        cut = draw(st.integers(1, min(len(value), len(other))))
        out = other[:cut] + value[cut:]
        if out == other:  # not a corruption: that other block itself, a valid value
            out = value[:-1]
    else:
        out = draw(st.binary(max_size=256))
    return out


def test_the_codec_raises_only_corrupt_block() -> None:
    tried = []

    @fuzz(3000, st.data())
    def one(data: st.DataObject) -> None:
        value, block_hash = data.draw(blocks())
        bad = data.draw(corruptions(value))
        if bad == value:
            return
        tried.append(bad)
        with pytest.raises(CorruptBlock):
            decode(bad, expected_hash=block_hash)
        with pytest.raises(CorruptBlock):
            decode(bad)  # the checksum alone catches it
        other = HASHES[(HASHES.index(block_hash) + 1) % len(HASHES)]
        with pytest.raises(CorruptBlock):  # a good value under the wrong key is a miss too
            decode(value, expected_hash=other)

    one()
    report("fuzz_codec", cases=len(tried))
    assert len(tried) > 1000 * SCALE


def _value(i: int) -> bytes:
    header = BlockHeader("float32", (1, 2, 1, 16, 4), 16, HASHES[i])
    return encode(header, bytes((i + j) % 256 for j in range(header.payload_len)))


def test_corrupt_values_in_redis_are_misses(redis_server: RedisServer) -> None:
    keys = KeySpace("fuzz-store", FP.root_hash())
    originals = [_value(i) for i in range(8)]
    plain = redis_server.client()
    tried = []

    async def check(position: int, bad: bytes) -> None:
        store = RedisBlockStore(keys, RedisStoreConfig(url=redis_server.url,
                                                       timeout_seconds=5.0))
        try:
            await store.put_many([EncodedBlock(HASHES[i], v) for i, v in enumerate(originals)])
            plain.set(keys.block_key(HASHES[position]), bad)
            corrupt_before = store_metrics.STORE_CORRUPT._value.get()
            got = await store.get_many(HASHES[:8])
            assert got[position] is None
            assert all(b is not None for i, b in enumerate(got) if i != position)
            assert len(await store.fetch_prefix(HASHES[:8])) == position
            assert store_metrics.STORE_CORRUPT._value.get() > corrupt_before
        finally:
            await store.close()

    @fuzz(300, st.integers(0, 7), st.data())
    def one(position: int, data: st.DataObject) -> None:
        bad = data.draw(corruptions(originals[position]))
        if bad == originals[position]:
            return
        tried.append(bad)
        asyncio.run(check(position, bad))

    one()
    report("fuzz_store", cases=len(tried))
    assert len(tried) > 100 * SCALE


def test_a_corrupt_block_is_recomputed_not_served(tiny_engine_factory: Callable[..., Any],
                                                  redis_server: RedisServer) -> None:
    tried: list[int] = []
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    [reference] = tiny_engine_factory().generate([PROMPT], params)

    async def check(position: int, corrupt: Callable[[bytes], bytes]) -> None:
        prefill = AsyncEngine(tiny_engine_factory())
        decode_engine = AsyncEngine(tiny_engine_factory())
        keys = KeySpace(f"fuzz-e2e-{len(tried)}", prefill.engine.root_hash)
        config = RedisStoreConfig(url=redis_server.url, timeout_seconds=5.0)
        a = KVStoreConnector(prefill, RedisBlockStore(keys, config))
        b = KVStoreConnector(decode_engine, RedisBlockStore(keys, config))
        try:
            prompt = prefill.engine.tokenize(PROMPT)
            first = await a.prefill(prompt, params)
            hashes = chain_hashes(a.root_hash, prompt[:-1], a.block_size)
            broken = position % len(hashes)
            with redis_server.client() as plain:
                key = keys.block_key(hashes[broken])
                plain.set(key, corrupt(plain.get(key)))
            loaded = await b.load_prefix(prompt)
            assert (len(loaded.blocks) if loaded else 0) == broken  # the prefix ends there
            assert first.handoff is not None and first.handoff.first_token is not None
            tokens = [first.handoff.first_token]
            async for out in b.decode(prompt, params, first.handoff.first_token):
                tokens += out.new_token_ids
            assert tokens == reference.token_ids
        finally:
            for c in (a, b):
                await c.store.close()
                c.engine.shutdown()

    @fuzz(12, st.integers(0, 7), st.data())
    def one(position: int, data: st.DataObject) -> None:
        def corrupt(value: bytes) -> bytes:
            bad = data.draw(corruptions(value))
            return bad if bad != value else value[:-1]
        tried.append(position)
        asyncio.run(check(position, corrupt))

    one()
    report("fuzz_connector", cases=len(tried))
    assert len(tried) == 12 * SCALE + random_cases(12)
