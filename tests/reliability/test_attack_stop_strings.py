"""Attack: the longest stop strings a request may carry, against the engine thread (issue 15).

Stop-string holdback used to check every prefix of every stop string at every token: four of
250K characters cost 20 ms a token at 16K characters of output, on the engine thread, for every
request sharing it. Now the worker bounds them (MAX_STOP strings of MAX_STOP_CHARS) and the
detokenizer matches incrementally. Here the real engine on the tiny model generates the same
greedy output with no stop strings and with the maximal ones, runs interleaved so that drift
hits both alike; the medians of the per-token times must stay within 2x.

The stop strings are built from the output itself (its first characters, then one it never
produces): each one's match runs along the whole output, the holdback's worst case, and none
ever completes, so both runs emit the same text.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from figures import report

from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.serving.protocol import MAX_STOP, MAX_STOP_CHARS

PROMPT = "the engineer builds many books before dinner"
TOKENS = 256
ROUNDS = 5


def _timed(engine: Any, params: SamplingParams) -> tuple[str, float]:
    # CPU seconds of this process, not wall time: the suite runs on several processes, and
    # another one's burst during one half of a round would read as the stop strings' cost.
    start = time.process_time()
    [done] = engine.generate([PROMPT], params)
    elapsed = time.process_time() - start
    assert len(done.token_ids) == TOKENS
    return done.text, elapsed / TOKENS


def test_maximal_stop_strings_cost_the_engine_under_twice_none(
        tiny_engine_factory: Callable[..., Any]) -> None:
    engine = tiny_engine_factory()
    plain = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    reference, _ = _timed(engine, plain)  # warm-up, and the text the stop strings follow
    assert reference
    # Each follows the output as far as a stop string may, then wants a character the tiny
    # model's text never has (a NUL): a live partial match at every token, never a stop.
    body = (reference * (MAX_STOP_CHARS // len(reference) + 1))[:MAX_STOP_CHARS - 2]
    stops = tuple(body + "\x00" + str(i) for i in range(MAX_STOP))
    assert all(len(s) == MAX_STOP_CHARS for s in stops) and "\x00" not in reference
    held = SamplingParams(max_tokens=TOKENS, ignore_eos=True, stop=stops)
    none_s: list[float] = []
    stop_s: list[float] = []
    for _ in range(ROUNDS):
        text, t = _timed(engine, plain)
        none_s.append(t)
        text_held, t = _timed(engine, held)
        stop_s.append(t)
        assert text_held == text == reference  # never stopped, nothing held back at the end
    none_us, stop_us = statistics.median(none_s) * 1e6, statistics.median(stop_s) * 1e6
    report("attack_stop_strings", tokens=TOKENS, output_chars=len(reference),
           stop_strings=MAX_STOP, stop_chars=MAX_STOP_CHARS, rounds=ROUNDS,
           per_token_us_none=round(none_us, 1), per_token_us_max_stops=round(stop_us, 1),
           ratio=round(stop_us / none_us, 3))
    assert stop_us < 2 * none_us
