"""Incremental detokenization and stop strings, per request.

Decoding a growing window rather than the whole output keeps each step O(1) in output length,
and text is only released once it is stable (no half-decoded UTF-8 byte sequence) and cannot
be the start of a stop string that the next tokens complete.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
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
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += delta
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True

    def replay(self, token_ids: list[int]) -> None:
        """Feed tokens whose text was already handed out, one by one as it was: what they
        produced counts as taken, and what was held back then stays held back."""
        for t in token_ids:
            self.add([t])
            self.take_delta(final=False)

    def _holdback(self) -> int:
        """Chars at the end of ``text`` that might still grow into a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

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
