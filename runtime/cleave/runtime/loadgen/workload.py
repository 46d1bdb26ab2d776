"""What each request asks for: its prompt and its output length.

Synthetic prompts are random common English words, each one token for the served model's
tokenizer (``tokens.py`` finds which), so a prompt of N words is N tokens. Random words keep
prompts distinct, so a prefix cache does not make the benchmark look better than real traffic
would; unless the workload asks for shared prefixes (:class:`SharedPrefix`): then request ``i``
starts with prefix ``i mod N`` of ``prefix_len`` tokens and goes on with its own suffix, vLLM's
``prefix_repetition`` workload, which shows what prefix reuse is worth.

Warm-up requests (:meth:`Workload.warmup`) have the workload's lengths but prompts of their
own, prefixes included: they warm the server up without filling its prefix cache for the
measured requests.

A prompts file is JSON Lines, one object per line: ``{"prompt": "..."}`` or, for the chat
endpoint, ``{"messages": [{"role": "user", "content": "..."}]}``; either may carry
``"max_tokens": N`` to override ``--output-len`` for that request. Requests use the lines in
order, starting again from the top when there are more requests than lines.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Short, frequent words: a single token each in the common BPE vocabularies.
_WORD_TEXT = """
the of and to in is it you that he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their
if will up other about out many then them these so some her would make like him into time has
look two more write go see number no way could people my than first water been call who oil its
now find long down day did get come made may part over new sound take only little work know place
year live me back give most very after thing our just name good sentence man think say great where
help through much before line right too mean old any same tell boy follow came want show also
around form three small set put end does another well large must big even such because turn here
why ask went men read need land different home us move try kind hand picture again change off play
spell air away animal house point page letter mother answer found study still learn should world
"""
WORDS = tuple(_WORD_TEXT.split())

_LENGTH = re.compile(r"^(?:(?:fixed:)?(\d+)|uniform:(\d+)-(\d+))$")


@dataclass(frozen=True)
class LengthDist:
    """A length drawn uniformly from ``low..high`` inclusive (``low == high``: fixed)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"a length range needs 1 <= low <= high, not {self.low}-{self.high}")

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def describe(self) -> str:
        return f"fixed:{self.low}" if self.low == self.high else f"uniform:{self.low}-{self.high}"


def parse_length(spec: str) -> LengthDist:
    """``N``, ``fixed:N`` or ``uniform:A-B`` (inclusive); raises ValueError naming the forms."""
    m = _LENGTH.match(spec.strip())
    if m is None:
        raise ValueError(f"bad length {spec!r}: use N, fixed:N or uniform:A-B "
                         "(e.g. uniform:32-512)")
    if m.group(1) is not None:
        n = int(m.group(1))
        return LengthDist(n, n)
    return LengthDist(int(m.group(2)), int(m.group(3)))


Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True)
class PromptEntry:
    """One line of a prompts file: exactly one of ``prompt`` and ``messages`` is set."""

    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    max_tokens: int | None = None


class PromptsFileError(ValueError):
    """A prompts file that cannot be used; the message names the file and line."""


def _entry(obj: object, where: str) -> PromptEntry:
    if not isinstance(obj, dict):
        raise PromptsFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise PromptsFileError(f"{where}: 'max_tokens' must be a positive integer")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise PromptsFileError(f"{where}: needs exactly one of 'prompt' (a string) and "
                               "'messages' (a list of {role, content} objects)")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise PromptsFileError(f"{where}: 'prompt' must be a non-empty string")
        return PromptEntry(prompt=prompt, max_tokens=max_tokens)
    if not isinstance(messages, list) or not messages:
        raise PromptsFileError(f"{where}: 'messages' must be a non-empty list")
    parsed: list[Message] = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise PromptsFileError(f"{where}: messages[{i}] must be an object with string "
                                   "'role' and 'content'")
        parsed.append((m["role"], m["content"]))
    return PromptEntry(messages=tuple(parsed), max_tokens=max_tokens)


def parse_prompts(lines: Iterable[str], source: str, chat: bool) -> tuple[PromptEntry, ...]:
    """Parse JSON Lines; blank lines are skipped. ``chat``: whether 'messages' may be used."""
    entries: list[PromptEntry] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptsFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno})"
                                   ) from None
        entry = _entry(obj, where)
        if entry.messages is not None and not chat:
            raise PromptsFileError(f"{where}: 'messages' needs --endpoint chat "
                                   "(the completions endpoint takes a 'prompt' string)")
        entries.append(entry)
    if not entries:
        raise PromptsFileError(f"{source}: no prompts (the file is empty)")
    return tuple(entries)


def load_prompts(path: Path, chat: bool) -> tuple[PromptEntry, ...]:
    try:
        with path.open(encoding="utf-8") as f:
            return parse_prompts(f, str(path), chat)
    except (OSError, UnicodeDecodeError) as e:
        raise PromptsFileError(f"cannot read {path}: {e}") from None


@dataclass(frozen=True)
class RequestSpec:
    index: int
    max_tokens: int
    prompt: str | None = None  # completions, or a chat turn with one user message
    messages: tuple[Message, ...] | None = None
    prompt_len: int = 0  # synthetic prompts only: tokens asked for, the prefix included
    prefix: int | None = None  # shared-prefix workloads: which prefix it starts with


def synthetic_prompt(rng: random.Random, length: int, vocab: tuple[str, ...] = WORDS) -> str:
    return " ".join(rng.choice(vocab) for _ in range(length))


@dataclass(frozen=True)
class SharedPrefix:
    """``num_prefixes`` prompt prefixes of ``prefix_len`` tokens; request i uses i mod N."""

    num_prefixes: int
    prefix_len: int

    def __post_init__(self) -> None:
        if self.num_prefixes < 1:
            raise ValueError(f"the number of shared prefixes must be at least 1, not "
                             f"{self.num_prefixes}")
        if self.prefix_len < 1:
            raise ValueError(f"the prefix length must be at least 1 token, not {self.prefix_len}")


@dataclass(frozen=True)
class Workload:
    """Request ``i`` is the same for a given seed whatever order the requests are sent in.

    ``vocab``: words that are one token each for the served model (``tokens.py``), so that
    synthetic lengths are in tokens; ``prompt_len`` is the whole prompt's, or with ``shared``
    the suffix's after the prefix.
    """

    output_len: LengthDist
    prompt_len: LengthDist = LengthDist(128, 128)
    prompts: tuple[PromptEntry, ...] = ()  # from a file; empty: synthetic prompts
    seed: int = 0
    shared: SharedPrefix | None = None
    vocab: tuple[str, ...] = WORDS

    def prefix(self, k: int) -> str:
        assert self.shared is not None
        # A str seed is hashed with SHA-512: the same prefix in every process and run.
        return synthetic_prompt(random.Random(f"prefix:{self.seed}:{k}"),
                                self.shared.prefix_len, self.vocab)

    def _spec(self, index: int, rng: random.Random, prefix: str | None,
              prefix_id: int | None) -> RequestSpec:
        if self.prompts:
            entry = self.prompts[index % len(self.prompts)]
            max_tokens = entry.max_tokens or self.output_len.sample(rng)
            return RequestSpec(index, max_tokens, prompt=entry.prompt, messages=entry.messages)
        length = self.prompt_len.sample(rng)
        max_tokens = self.output_len.sample(rng)
        text = synthetic_prompt(rng, length, self.vocab)
        if prefix is None:
            return RequestSpec(index, max_tokens, prompt=text, prompt_len=length)
        assert self.shared is not None
        return RequestSpec(index, max_tokens, prompt=f"{prefix} {text}",
                           prompt_len=self.shared.prefix_len + length, prefix=prefix_id)

    def request(self, index: int) -> RequestSpec:
        rng = random.Random(self.seed * 1_000_003 + index)
        if self.shared is None or self.prompts:
            return self._spec(index, rng, None, None)
        k = index % self.shared.num_prefixes
        return self._spec(index, rng, self.prefix(k), k)

    def warmup(self, index: int) -> RequestSpec:
        """The workload's lengths with a prompt (and prefix) no measured request shares."""
        rng = random.Random(f"warmup:{self.seed}:{index}")
        if self.shared is None or self.prompts:
            return self._spec(index, rng, None, None)
        prefix = synthetic_prompt(random.Random(f"warmup-prefix:{self.seed}:{index}"),
                                  self.shared.prefix_len, self.vocab)
        return self._spec(index, rng, prefix, None)

    def longest_prompt(self) -> str:
        """A synthetic prompt of the longest length asked (to check the token arithmetic)."""
        high = self.prompt_len.high + (self.shared.prefix_len if self.shared else 0)
        return synthetic_prompt(random.Random(f"check:{self.seed}"), high, self.vocab)

    def describe(self) -> str:
        if self.prompts:
            source = f"{len(self.prompts)} prompts from a file"
        elif self.shared is not None:
            source = (f"{self.shared.num_prefixes} shared prefixes of {self.shared.prefix_len} "
                      f"tokens + suffixes of {self.prompt_len.describe()} tokens")
        else:
            source = f"synthetic prompts of {self.prompt_len.describe()} tokens"
        return f"{source}, output {self.output_len.describe()} tokens"
