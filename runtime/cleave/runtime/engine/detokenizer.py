"""Incremental detokenization and stop strings, per request.

Decoding a growing window rather than the whole output keeps each step O(1) in output length,
and text is only released once it is stable (no half-decoded UTF-8 byte sequence) and cannot
be the start of a stop string that the next tokens complete.
"""

from __future__ import annotations

from typing import Any


class _StopMatcher:
    """Knuth-Morris-Pratt over the output as it grows: ``state`` is the longest prefix of the
    stop string that ends the text so far. Each new character costs O(1) amortized whatever
    the stop string's length, where searching the text's tail and testing each of its
    suffixes cost O(length) and O(length^2) per token (issue 15: long stop strings froze the
    engine thread)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.fail = [0] * len(stop)  # fail[i]: the longest proper border of stop[:i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k
        self.state = 0

    def feed(self, text: str, start: int) -> int | None:
        """Advance over ``text[start:]``; where the first complete match begins, or None."""
        stop, fail, k = self.stop, self.fail, self.state
        for i in range(start, len(text)):
            c = text[i]
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
            if k == len(stop):
                self.state = k
                return i + 1 - k
        self.state = k
        return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self._matchers = [_StopMatcher(s) for s in stop]
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def add(self, token_ids: list[int]) -> None:
        """Feed new tokens; sets ``stopped`` and truncates ``text`` if a stop string appears."""
        if self.stopped:
            return
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = len(self.text)
        self.text += delta
        found = [at for m in self._matchers if (at := m.feed(self.text, start)) is not None]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True

    def replay(self, token_ids: list[int]) -> None:
        """Feed tokens whose text was already handed out, one by one as it was: what they
        produced counts as taken, and what was held back then stays held back."""
        for t in token_ids:
            self.add([t])
            self.take_delta(final=False)

    def _holdback(self) -> int:
        """Chars at the end of ``text`` that might still grow into a stop string."""
        return max((m.state for m in self._matchers), default=0)

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out; everything when ``final``."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._holdback()
        if final and not self.stopped:
            # Flush any bytes held back as an incomplete character.
            tail = self._decode(self.ids[self.prefix_offset:])
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            if len(tail) > len(prefix):
                self.text += tail[len(prefix):]
                self.prefix_offset = self.read_offset = len(self.ids)
            end = len(self.text)
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta
