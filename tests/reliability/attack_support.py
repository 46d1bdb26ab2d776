"""What the attack tests share: the store counters a worker publishes."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from serving_stack import Proc

from cleave.common import metric_names as names


def scrape(worker: Proc) -> dict[str, int]:
    """The worker's store counters: blocks verified (hits), corrupt, missed."""
    with urllib.request.urlopen(worker.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    wanted = {names.STORE_HITS: "hits", names.STORE_CORRUPT: "corrupt",
              names.STORE_MISSES: "misses"}
    out = dict.fromkeys(wanted.values(), 0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.removesuffix("_total") in wanted:
                out[wanted[s.name.removesuffix("_total")]] += int(s.value)
    return out
