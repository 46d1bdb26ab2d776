"""Structured outputs: which tokens a request's grammar allows next (llguidance).

A request's grammar arrives as llguidance's grammar text (``SamplingParams.grammar``; the
router builds it from ``response_format`` or vLLM's ``guided_*`` fields). The matcher's state
is a pure function of (grammar, output tokens so far): :meth:`Constraint.allowed` brings it up to
date by consuming the tokens it has not seen, so a decode worker that received a prefill
worker's first token, a resumed request that holds the tokens already sent, and a preempted
request all end up in the state a single uninterrupted run would have, with nothing carried
between processes but the tokens.

llguidance was picked by measured cost on SmolLM2's 49152-token vocabulary (bench/structured.py):
the lowest grammar compile time of xgrammar, llguidance and outlines-core, a mask in tens of
microseconds, and no dependencies (xgrammar pulls in triton).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance

from cleave.runtime.engine.sequence import RequestError

BITS = 32  # one int32 word of the mask holds 32 tokens


def mask_words(vocab: int) -> int:
    return (vocab + BITS - 1) // BITS


class Grammars:
    """The engine's grammar compiler: llguidance's view of the tokenizer (built once, on the
    first structured request: it takes about a second) and a matcher per request."""

    def __init__(self, hf_tokenizer: Any, vocab: int, eos_token_ids: Iterable[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab = vocab
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # requests arrive on the event loop, steps elsewhere

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab, eos_token=self._eos)
            return self._tokenizer

    def constraint(self, grammar: str) -> Constraint:
        """A new request's constraint; RequestError when the grammar does not compile."""
        return Constraint(self.tokenizer(), grammar, self._eos)


class Constraint:
    """One request's matcher, kept in step with its output tokens."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str,
                 eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._grammar = grammar
        self._matcher = self._fresh()
        self._consumed = 0

    def _fresh(self) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"the structured output's grammar is invalid: "
                               f"{matcher.get_error()}")
        return matcher

    def _sync(self, output: Sequence[int]) -> None:
        if self._consumed > len(output):  # fewer tokens than seen: start again from none
            self._matcher, self._consumed = self._fresh(), 0
        if self._consumed < len(output):
            self._matcher.consume_tokens(list(output[self._consumed:]))
            self._consumed = len(output)

    def fill(self, output: Sequence[int], mask_row: Any) -> None:
        """Write the allowed next tokens after ``output`` into ``mask_row``, a contiguous int32
        tensor row of :func:`mask_words` words (bit ``t % 32`` of word ``t // 32``)."""
        self._sync(output)
        if self._matcher.is_error():
            # Tokens the grammar refused (cannot happen to tokens it chose; a resumed request
            # carries only those): end the request at once rather than stop the engine.
            mask_row.zero_()
            for eos in self._eos:
                mask_row[eos // BITS] |= _bit(eos % BITS)
            return
        self._matcher.unsafe_compute_mask_ptr(mask_row.data_ptr(),
                                              mask_row.numel() * mask_row.element_size())

    def accepts(self, output: Sequence[int]) -> bool:
        """Whether ``output`` is a complete sentence of the grammar (tests, diagnostics)."""
        self._sync(output)
        return self._matcher.is_accepting() and not self._matcher.is_error()


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == BITS - 1 else 1 << i
