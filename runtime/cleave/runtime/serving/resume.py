"""Resuming a decode that a worker dropped mid-stream: pure functions over the wire format.

The router keeps the tokens it has sent. When their decode worker dies, another one goes on
from there: its prompt is the request's prompt plus the tokens sent but the last, and the
last goes in as the first token, exactly as a prefill worker's first token does. Its lines
are then told in the original request's terms, so the client sees one response.

Greedy requests continue exactly as they would have. Sampled ones continue with fresh draws
(their randomness is keyed on the output index, which restarts), and a stop string that would
have spanned the break is not seen.
"""

from __future__ import annotations

from typing import Any


def continuation(payload: dict[str, Any], prompt: list[int], sent: list[int],
                 max_tokens: int) -> dict[str, Any]:
    """The decode request that goes on from the tokens already sent: their KV is rebuilt
    (from the store's blocks where it has them), so a missing block must be recomputed."""
    return {**payload, "prompt_token_ids": prompt + sent[:-1], "first_token": sent[-1],
            "sampling": {**payload["sampling"], "max_tokens": max_tokens - len(sent) + 1},
            "kv_load_failure_policy": "recompute"}


def rebased(line: dict[str, Any], prompt_len: int, sent: int) -> dict[str, Any]:
    """A continuation's line in the original request's terms: its prompt held ``sent - 1``
    of the request's output tokens, and its first token was the last one sent."""
    out = dict(line)
    if "prompt_tokens" in out:
        out["prompt_tokens"] = prompt_len
    if "completion_tokens" in out:
        out["completion_tokens"] = int(out["completion_tokens"]) + sent - 1
    if "cached_tokens" in out:
        out["cached_tokens"] = min(int(out["cached_tokens"]), prompt_len)
    return out
