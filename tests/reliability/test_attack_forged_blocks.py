"""Attack: forge KV blocks in Redis under the chain hashes of a real prompt (issue 15).

Anyone who can write to Redis used to be able to store KV of a malicious prompt under the keys
of a real one (a block was checked by an unkeyed XXH3 checksum and the hash in its own header):
every request sharing that prefix was then steered. Now each block carries an HMAC keyed by
the service's secret KV salt, and a block whose MAC fails is a miss, counted, recomputed.

A real stack (redis-server, a prefill and a decode worker with a salt, the router) and, in
this process, a legitimate writer: an engine with the service's salt that prefills each victim
prompt into the store (genuine blocks) and the reference output (recomputed, no store). The
attacker overwrites a victim prompt's blocks with a malicious prompt's KV (or garbage) behind
well-formed headers naming the right block hashes, sealed with a MAC key of its own (it lacks
the salt) or with the old unkeyed checksum. Each victim prompt is new to the stack's workers,
whose own prefix caches would otherwise shadow the store. Served through the router it must
give the reference output; the worker counts each forgery as corrupt, and no forged block is
ever loaded (``forged_served`` must be 0).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from attack_support import scrape
from figures import report
from serving_stack import Stack, start_stack

from cleave.common.settings import INTERNAL_TOKEN_ENV, KV_SALT_ENV
from cleave.kv_store.block_hash import chain_hashes
from cleave.kv_store.codec import BlockHeader, decode, encode, mac_key
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.runtime.engine.async_engine import AsyncEngine
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.kv_connector import KVStoreConnector

SALT = "the-service-kv-salt"
TOKEN = "the-service-internal-token"
LENGTH = 81  # five full blocks of 16 (the last token is always recomputed)
OUTPUT = SamplingParams(max_tokens=8)  # greedy
EVIL = [260 + (11 * i) % 240 for i in range(LENGTH)]
GUESS = mac_key("an-attacker-guess")
# (name, the forger's key, the first block forged, its payload: the malicious prompt's KV or,
# None, a constant that wrecks any output it reaches): a key of its own, the old unkeyed
# checksum, one block only behind four genuine ones, and garbage.
FORGERIES: tuple[tuple[str, bytes, int, bytes | None], ...] = (
    ("wrong_key", GUESS, 0, None), ("unkeyed", b"", 0, None),
    ("last_block_only", GUESS, 4, None), ("garbage_kv", GUESS, 0, b"\x42"))


def victim(n: int) -> list[int]:
    """A prompt per forgery, none of whose blocks a worker has seen."""
    return [10 + (7 * i + 13 * n) % 240 for i in range(LENGTH)]


def stats(stack: Stack) -> dict[str, Any]:
    req = urllib.request.Request(stack.workers[0].url + "/internal/stats",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.loads(r.read()))


async def test_forged_blocks_are_never_served(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        tiny_engine_factory: Callable[..., Any]) -> None:
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    monkeypatch.setenv(KV_SALT_ENV, SALT)
    stack = start_stack(tiny_model_dir, tmp_path, prefill=1, decode=1)
    engine = AsyncEngine(tiny_engine_factory(salt=SALT))
    plain = tiny_engine_factory()  # the reference: everything recomputed
    try:
        info = stats(stack)
        assert info["kv_root_hash"] == engine.engine.root_hash.hex()  # the service's chains
        keys = KeySpace(info["kv_namespace"], engine.engine.root_hash, mac_key(SALT))
        writer = KVStoreConnector(engine, RedisBlockStore(
            keys, RedisStoreConfig(url=stack.redis.url, timeout_seconds=5.0)))
        client = openai.OpenAI(base_url=stack.base_url, api_key="-", max_retries=0)
        redis = stack.redis.client()
        block_size = int(info["block_size"])
        await writer.prefill(EVIL, SamplingParams(max_tokens=1))
        # The attacker's KV: the malicious prompt's blocks (the model is public).
        payloads = [decode(redis.get(keys.block_key(h)), h, keys.mac_key)
                    for h in chain_hashes(keys.fingerprint_root, EVIL[:-1], block_size)]
        prefill, decode_worker = stack.workers
        figures: dict[str, dict[str, int]] = {}
        for n, (name, key, first, fill) in enumerate(FORGERIES):
            prompt = victim(n)
            [ref] = plain.generate([prompt], OUTPUT)
            await writer.prefill(prompt, SamplingParams(max_tokens=1))  # genuine blocks
            target = chain_hashes(keys.fingerprint_root, prompt[:-1], block_size)
            assert len(target) == len(payloads) == 5
            forged = {i: encode(BlockHeader(header.dtype, header.shape, header.num_tokens,
                                            target[i]),
                                fill * payload.nbytes if fill else payload, key)
                      for i, (header, payload) in enumerate(payloads) if i >= first}
            for i, value in forged.items():
                redis.set(keys.block_key(target[i]), value)
            before = scrape(prefill), scrape(decode_worker)
            text = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                             temperature=0).choices[0].text
            after = scrape(prefill), scrape(decode_worker)
            delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
            # The prompt is cached, so the router serves it whole on the decode worker: one
            # lookup, which met the forged values (a whole request saves nothing, so nothing
            # rewrote them). Its hits past the genuine blocks are forged blocks served.
            assert delta[0] == {"hits": 0, "corrupt": 0, "misses": 0}, delta
            assert all(redis.get(keys.block_key(target[i])) == v for i, v in forged.items())
            served = max(0, delta[1]["hits"] - first)
            figures[name] = {"forged": len(forged), "served": served,
                             "rejected": delta[1]["corrupt"], "genuine_served": delta[1]["hits"],
                             "same_output": int(text == ref.text)}
            assert served == 0, figures
            assert text == ref.text, figures
            assert delta[1]["corrupt"] == 1, figures  # the lookup met it, counted it, stopped
            assert delta[1]["hits"] == first, figures  # the genuine blocks before it serve
        report("attack_forged_blocks", blocks=len(payloads),
               forged_written=sum(f["forged"] for f in figures.values()),
               forged_served=sum(f["served"] for f in figures.values()),
               rejected=sum(f["rejected"] for f in figures.values()), **figures)
    finally:
        if "writer" in locals():
            await writer.store.close()
        engine.shutdown()
        stack.stop()
