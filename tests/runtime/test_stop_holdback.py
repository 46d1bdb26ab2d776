"""Stop strings cost the engine thread O(1) per output character whatever their length
(issue 15): checking each new token's text against every prefix of every stop string was
quadratic in the stop string's length, 20 ms a token with four long ones."""

from __future__ import annotations

import time

from cleave.runtime.engine.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token t is the character chr(t): decoding costs nothing, the stop check is all."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def _run(stop: tuple[str, ...], text: str) -> tuple[str, float]:
    d = IncrementalDetokenizer(CharTokenizer(), stop)
    out = []
    start = time.process_time()  # CPU: unmoved by other processes' load
    for c in text:
        d.add([ord(c)])
        out.append(d.take_delta(final=False))
        if d.stopped:
            break
    out.append(d.take_delta(final=True))
    return "".join(out), time.process_time() - start


def test_long_stop_strings_cost_about_what_none_cost() -> None:
    text = "xa" * 1500
    # The output always ends with each stop string's first character, and never with more:
    # the old check tried every longer prefix first, at every token.
    stops = tuple("a" + "b" * 3998 + tail for tail in "wxyz")
    plain, none_s = _run((), text)
    held, stops_s = _run(stops, text)
    assert held == plain == text
    print(f"\nreliability stop_strings_per_token_us none={none_s / len(text) * 1e6:.1f} "
          f"four_4000_char={stops_s / len(text) * 1e6:.1f}")
    assert stops_s < 4 * none_s + 0.3  # the old check: over 10 s here


def test_stop_strings_still_stop_and_hold_back_what_may_grow_into_one() -> None:
    d = IncrementalDetokenizer(CharTokenizer(), ("abcab", "zz"))
    deltas = []
    for c in "xxabcabd":
        d.add([ord(c)])
        deltas.append(d.take_delta(final=False))
    assert deltas == ["x", "x", "", "", "", "", "", ""]  # "abcab" completes: stop
    assert d.stopped and d.text == "xx"
    d = IncrementalDetokenizer(CharTokenizer(), ("aab",))
    for c in "aaac":
        d.add([ord(c)])
    assert d.take_delta(final=False) == "aaac"  # "aaa" could have become "aab", "aaac" not
    assert not d.stopped
    d = IncrementalDetokenizer(CharTokenizer(), ("aab",))
    for c in "aaab!":
        d.add([ord(c)])
    assert d.stopped and d.text == "a"  # KMP falls back inside "aaa" to find "aab"
