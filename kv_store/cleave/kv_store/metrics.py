"""Prometheus metrics of the block store (names in :mod:`cleave.common.metric_names`)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from cleave.common import metric_names as names

STORE_HITS = Counter(names.STORE_HITS, "Blocks found in the KV block store")
STORE_MISSES = Counter(names.STORE_MISSES,
                       "Blocks looked for and not found (absent, evicted or corrupt)")
STORE_BYTES_WRITTEN = Counter(names.STORE_WRITTEN_BYTES, "Value bytes written to the store")
STORE_BYTES_READ = Counter(names.STORE_READ_BYTES, "Value bytes read from the store")
STORE_CORRUPT = Counter(names.STORE_CORRUPT,
                        "Stored values that failed their header, checksum or key check")
STORE_EVICTIONS = Counter(names.STORE_EVICTIONS,
                          "Holes in a block chain: a block gone while later ones remain "
                          "(evicted, or expired)")
STORE_ERRORS = Counter(names.STORE_ERRORS, "Store operations that failed or timed out",
                       ["op"])
STORE_OP_SECONDS = Histogram(
    names.STORE_OP_SECONDS, "Latency of block store operations", ["op"],
    buckets=names.STORE_OP_BUCKETS)
