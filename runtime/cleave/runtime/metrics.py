"""Prometheus metrics of the data plane (names per docs/metrics.md, ``cleave_`` prefix)."""

from __future__ import annotations

from prometheus_client import Counter

KV_RECOMPUTE_FALLBACKS = Counter(
    "cleave_kv_recompute_fallbacks",
    "Decode requests that recomputed prompt blocks the store should have held "
    "(missing, evicted, corrupt, or the store unavailable)")
KV_LOADED_BLOCKS = Counter("cleave_kv_loaded_blocks",
                           "KV blocks loaded from the store instead of computed", ["purpose"])
