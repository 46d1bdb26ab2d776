"""What the server saw of the measured requests: the KV block store's counters, read from the
workers' ``/metrics`` before and after the measured run.

Against Cleave's router, ``GET /internal/workers`` lists the workers; their ``/metrics`` pages
hold the block store's counters (docs/metrics.md). Other servers have no such list: the
figures are then absent. The counters are the whole server's, so traffic from other clients
during the run counts too; warm-up requests do not (the first scrape follows them).

The figure that matters for prefix reuse is ``kv_store_hit_rate``: the share of the measured
requests' prompt tokens whose KV was read from the store instead of computed. Blocks read from
the store are ``cleave_kv_store_hits_total``; a decode worker continuing a prefilled request
reads blocks too (``cleave_kv_loaded_blocks_total{purpose="decode"}``), which is the handoff,
not reuse, so those are taken out. The store's own misses only count holes and corrupt blocks
(a prompt whose chain simply ends is not a miss), so hits over hits plus misses says how
healthy the store is, not how much was reused: it is reported as ``kv_store_block_hit_ratio``.

The router's own ``/metrics`` adds how it routed the requests (``routing``: requests by path):
a prompt served whole by a decode worker reads the store for its prefix but writes nothing, so a
run routed that way reuses little through the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from cleave.common import metric_names as names
from cleave.kv_store.block_hash import DEFAULT_BLOCK_SIZE
from cleave.runtime.loadgen.client import headers

_HITS = names.total(names.STORE_HITS)
_MISSES = names.total(names.STORE_MISSES)
_LOADED = names.total(names.KV_LOADED_BLOCKS)
_ROUTED = names.total(names.ROUTING_DECISIONS)
_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Counters:
    """Sums over every scraped worker."""

    store_hits: float = 0.0
    store_misses: float = 0.0
    handoff_blocks: float = 0.0  # read by decode workers to continue prefilled requests
    routes: tuple[tuple[str, float], ...] = ()  # the router's requests by path, sorted


def parse(text: str) -> Counters:
    """The counters of one ``/metrics`` page (absent ones are 0)."""
    hits = misses = handoff = 0.0
    routes: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == _HITS:
                hits += s.value
            elif s.name == _MISSES:
                misses += s.value
            elif s.name == _LOADED and s.labels.get("purpose") == "decode":
                handoff += s.value
            elif s.name == _ROUTED:
                path = s.labels.get("path", "")
                routes[path] = routes.get(path, 0.0) + s.value
    return Counters(hits, misses, handoff, tuple(sorted(routes.items())))


def add(counters: Sequence[Counters]) -> Counters:
    routes: dict[str, float] = {}
    for c in counters:
        for path, n in c.routes:
            routes[path] = routes.get(path, 0.0) + n
    return Counters(sum(c.store_hits for c in counters), sum(c.store_misses for c in counters),
                    sum(c.handoff_blocks for c in counters), tuple(sorted(routes.items())))


async def worker_urls(session: aiohttp.ClientSession, root: str,
                      api_key: str | None) -> list[str] | None:
    """The workers Cleave's router lists, or None where the server lists none."""
    try:
        async with asyncio.timeout(_TIMEOUT_S), \
                session.get(root + "/internal/workers", headers=headers(api_key)) as r:
            if r.status != 200:
                return None
            body = await r.json(content_type=None)
        return sorted({str(w["url"]) for role in ("prefill", "decode")
                       for w in body.get(role, [])})
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError,
            AttributeError):
        return None


async def scrape(session: aiohttp.ClientSession, urls: Sequence[str]) -> Counters:
    """Sum the counters of every ``/metrics`` (the router's and its workers'); raises on an
    unreachable one (a partial sum would understate the figures)."""
    async def one(url: str) -> Counters:
        async with asyncio.timeout(_TIMEOUT_S), session.get(url + "/metrics") as r:
            r.raise_for_status()
            return parse(await r.text())

    return add(await asyncio.gather(*(one(u) for u in urls)))


def figures(before: Counters, after: Counters, prompt_tokens: int, workers: int,
            block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, Any]:
    """The run's share of the counters. A worker restarted during the run resets its counters:
    a negative difference is then taken as 0 rather than reported."""
    hits = max(0.0, after.store_hits - before.store_hits)
    misses = max(0.0, after.store_misses - before.store_misses)
    handoff = max(0.0, after.handoff_blocks - before.handoff_blocks)
    reused = max(0.0, hits - handoff)
    earlier = dict(before.routes)
    routing = {path: int(max(0.0, n - earlier.get(path, 0.0))) for path, n in after.routes}
    return {
        "workers_scraped": workers,
        "routing": {path: n for path, n in routing.items() if n},
        "kv_store_block_hits": int(hits),
        "kv_store_block_misses": int(misses),
        "kv_store_handoff_blocks": int(handoff),
        "kv_store_prefix_blocks": int(reused),
        "kv_store_block_hit_ratio": hits / (hits + misses) if hits + misses else None,
        "kv_store_hit_rate": (min(1.0, reused * block_size / prompt_tokens)
                              if prompt_tokens else None),
        "block_size": block_size,
    }
