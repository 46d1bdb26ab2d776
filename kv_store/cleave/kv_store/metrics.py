"""Prometheus metrics of the block store (names per docs/metrics.md, ``cleave_`` prefix)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

STORE_HITS = Counter("cleave_kv_store_hits", "Blocks found in the KV block store")
STORE_MISSES = Counter("cleave_kv_store_misses",
                       "Blocks looked for and not found (absent, evicted or corrupt)")
STORE_BYTES_WRITTEN = Counter("cleave_kv_store_written_bytes", "Value bytes written to the store")
STORE_BYTES_READ = Counter("cleave_kv_store_read_bytes", "Value bytes read from the store")
STORE_CORRUPT = Counter("cleave_kv_store_corrupt_blocks",
                        "Stored values that failed their header, checksum or key check")
STORE_EVICTIONS = Counter("cleave_kv_store_evictions_noticed",
                          "Holes in a block chain: a block gone while later ones remain "
                          "(evicted, or expired)")
STORE_ERRORS = Counter("cleave_kv_store_errors", "Store operations that failed or timed out",
                       ["op"])
STORE_OP_SECONDS = Histogram(
    "cleave_kv_store_operation_seconds", "Latency of block store operations", ["op"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
