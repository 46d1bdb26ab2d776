"""vLLM's per-request ``cache_salt``: requests with different salts share no cached KV block,
neither in an engine's prefix cache nor in the Redis store; requests with the same salt do.

End to end on real processes (a redis-server, a prefill and a decode worker, the router) with
the official ``openai`` client, plus the block manager's own rule.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from block_manager_support import BS, ROOT, computed, make_seq, prompt
from serving_stack import Stack, post_raw, start_stack

from cleave.common import metric_names as names
from cleave.runtime.engine.block_manager import BlockManager
from cleave.runtime.engine.sequence import SamplingParams, Sequence

LONG = "the quick brown fox jumps over the lazy dog " * 8  # > 16 tokens: disaggregated
LOADED = names.total(names.KV_LOADED_BLOCKS)
RECOMPUTED = names.total(names.KV_RECOMPUTE_FALLBACKS)
DECISIONS = names.total(names.ROUTING_DECISIONS)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("salt-logs"))
    yield s
    s.stop()


def _metric(url: str, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def _complete(stack: Stack, text: str, salt: str | None) -> Any:
    client = openai.OpenAI(base_url=stack.base_url, api_key="-", max_retries=0, timeout=60)
    extra = {} if salt is None else {"cache_salt": salt}
    return client.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0,
                                     extra_body=extra)


def _cached(response: Any) -> int:
    return int(response.usage.prompt_tokens_details.cached_tokens)


def test_salts_never_share_blocks_and_a_salt_shares_with_itself(stack: Stack) -> None:
    prefill, decode = stack.workers
    assert stack.router is not None
    text = f"{time.time_ns()} " + LONG  # nothing of it is cached anywhere yet
    keys = stack.redis.client().dbsize()
    first = _complete(stack, text, "tenant-a")
    stored = stack.redis.client().dbsize() - keys
    assert stored >= 4  # the prefill worker saved tenant a's blocks

    # Same prompt, another salt: the prefill worker finds none of a's blocks in the store,
    # writes its own (as many again), and the decode worker's prefix cache has none either;
    # the decode worker loads b's blocks, handed over under b's salt, and recomputes nothing.
    loaded = _metric(prefill.url, LOADED + '{purpose="prefix"}')
    handed = _metric(decode.url, LOADED + '{purpose="decode"}')
    recomputed = _metric(decode.url, RECOMPUTED)
    other = _complete(stack, text, "tenant-b")
    assert _metric(prefill.url, LOADED + '{purpose="prefix"}') == loaded
    assert _metric(decode.url, LOADED + '{purpose="decode"}') == handed + stored
    assert _metric(decode.url, RECOMPUTED) == recomputed
    assert stack.redis.client().dbsize() - keys == 2 * stored
    assert _cached(other) == 0
    no_salt = _complete(stack, text, None)
    assert _cached(no_salt) == 0
    assert stack.redis.client().dbsize() - keys == 3 * stored

    # The same salt again: the router sees a's blocks in the store (so the prompt is served
    # whole by the decode worker) and that worker's prefix cache serves them.
    mostly_cached = DECISIONS + '{path="decode_only",reason="mostly_cached"}'
    before = _metric(stack.router.url, mostly_cached)
    again = _complete(stack, text, "tenant-a")
    assert _metric(stack.router.url, mostly_cached) == before + 1
    assert _cached(again) >= stored * 16 - 16
    assert again.choices[0].text == first.choices[0].text  # the cache changes no output
    assert stack.redis.client().dbsize() - keys == 3 * stored


@pytest.mark.parametrize("salt", ["", 7, ["a"], "x" * 1025])
def test_a_bad_cache_salt_is_a_400_naming_it(stack: Stack, salt: object) -> None:
    import json

    for path, body in (("/completions", {"prompt": "hi"}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, answer = post_raw(stack.base_url + path, json.dumps(
            {"model": "tiny", "cache_salt": salt, **body}).encode())
        assert status == 400, answer
        assert answer["error"]["param"] == "cache_salt"  # type: ignore[index]


def _salted(tokens: list[int], salt: str | None) -> Sequence:
    seq = make_seq(tokens)
    seq.params = SamplingParams(cache_salt=salt)
    return seq


def test_the_prefix_cache_matches_within_a_salt_only() -> None:
    bm = BlockManager(32, BS, ROOT)
    a = _salted(prompt(13), "a")
    assert bm.allocate(a)
    computed(bm, a)
    for salt in ("b", None):
        other = _salted(prompt(13), salt)
        assert bm.allocate(other)
        assert other.num_cached_tokens == 0
    same = _salted(prompt(13), "a")
    assert bm.allocate(same)
    assert same.num_cached_tokens == 12
