"""Resuming a decode that a worker dropped mid-stream: pure functions over the wire format.

The router keeps the tokens it has sent. When their decode worker dies, another one goes on
from there: the same prompt, the last token sent as the first token (as a prefill worker's
first token goes), and the ones before it as ``earlier_token_ids``. The new worker holds them
all as output: its detokenizer replays them (so a character split across tokens, or a stop
string spanning the break, comes out as if nothing had happened), seeded sampling goes on at
the right output index, and its counts are the request's own. Greedy output goes on exactly.
"""

from __future__ import annotations

from cleave.runtime.serving.wire import GenerateRequest, TokenLine


def continuation(payload: GenerateRequest, sent: list[int]) -> GenerateRequest:
    """The decode request that goes on from the tokens already sent. Their KV is rebuilt
    (from the store's blocks of the prompt where it has them), so anything missing is
    recomputed whatever the request's policy: the client is already reading the answer."""
    return payload.model_copy(update={"first_token": sent[-1], "earlier_token_ids": sent[:-1],
                                      "kv_load_failure_policy": "recompute"})


def rebased(line: TokenLine, cached_tokens: int | None) -> TokenLine:
    """A continuation's line with the prompt tokens the request really found cached (the
    continuation's own lookup found the blocks the first attempt saved)."""
    return line.model_copy(update={"cached_tokens": cached_tokens})
