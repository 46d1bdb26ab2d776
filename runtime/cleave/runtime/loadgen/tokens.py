"""Prompt lengths in the served model's tokens, counted by the server itself.

``cleave bench`` has no tokenizer of its own (it is a plain HTTP client, for any server). At
start it asks the server's ``POST /tokenize`` (vLLM's endpoint, which Cleave's router serves
too) which of a list of common English words are one token both at the start of a text and
after a space, and keeps those. Byte-level BPE and SentencePiece tokenizers split text at
spaces before they merge, so N such words joined by single spaces are exactly N tokens: every
synthetic prompt is then built locally, as many as asked, without a round trip per prompt. One
check of a prompt of the longest asked length against ``/tokenize`` confirms the arithmetic for
this tokenizer before anything is measured.

Counts are of the prompt text alone (``add_special_tokens: false``), as vLLM's benchmark counts
its synthetic prompts: a BOS the server adds, or a chat template's tokens, come on top (the
report's token totals are the server's ``usage``, which includes them).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import aiohttp

from cleave.runtime.loadgen.client import SetupError, headers

CountTokens = Callable[[str], Awaitable[int]]

# Fewer one-token words than this and the prompts would be too repetitive to stand for text.
MIN_WORDS = 8
_PROBES_IN_FLIGHT = 16
_DETAIL_CHARS = 200


def server_root(api_root: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port``: vLLM serves /tokenize beside /v1."""
    parts = urlsplit(api_root)
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path.removesuffix('/v1')}"


def server_counter(session: aiohttp.ClientSession, root: str, model: str,
                   api_key: str | None, timeout: float = 30.0) -> CountTokens:
    """Counts the tokens of a text with the server's ``POST /tokenize``."""
    url = root + "/tokenize"

    async def count(text: str) -> int:
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        try:
            async with asyncio.timeout(timeout), \
                    session.post(url, json=body, headers=headers(api_key)) as resp:
                raw = await resp.text()
                if resp.status != 200:
                    raise SetupError(
                        f"POST {url} answered {resp.status}: {raw[:_DETAIL_CHARS]} (prompt "
                        "lengths are counted in the server's tokens with vLLM's /tokenize; for "
                        "a server without it, give the prompts with --prompts FILE)")
                n = json.loads(raw).get("count")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise SetupError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
        except (ValueError, AttributeError) as e:
            raise SetupError(f"POST {url} did not answer a /tokenize result: {e}") from None
        if type(n) is not int:
            raise SetupError(f"POST {url} answered no integer 'count': {raw[:_DETAIL_CHARS]}")
        return n

    return count


async def one_token_words(count: CountTokens, candidates: Iterable[str]) -> tuple[str, ...]:
    """The candidates that are one token at the start of a text and after a space: "w w w"
    is then 3 tokens. Their order is kept, so prompts are reproducible for a seed."""
    words = tuple(dict.fromkeys(candidates))
    gate = asyncio.Semaphore(_PROBES_IN_FLIGHT)

    async def probe(word: str) -> bool:
        async with gate:
            return await count(f"{word} {word} {word}") == 3

    found = await asyncio.gather(*(probe(w) for w in words))
    kept = tuple(w for w, ok in zip(words, found, strict=True) if ok)
    if len(kept) < MIN_WORDS:
        raise SetupError(f"only {len(kept)} of {len(words)} common words are one token each for "
                         "this server's tokenizer: synthetic prompts cannot be sized in tokens; "
                         "give the prompts with --prompts FILE")
    return kept


async def check_length(count: CountTokens, text: str, want: int) -> None:
    """Refuse to run when a built prompt is not the length it was built to be."""
    got = await count(text)
    if got != want:
        raise SetupError(f"a synthetic prompt built to be {want} tokens is {got} for this "
                         "server's tokenizer (it merges words across spaces); give the prompts "
                         "with --prompts FILE")
