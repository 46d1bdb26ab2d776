"""The engine's side of the block store: save exported KV, load a cached prefix.

A prefill worker saves the full blocks of each prompt it computes; any worker that later sees a
prompt starting the same way loads those blocks instead of recomputing them, and a decode
worker loads the blocks a prefill worker handed over. Store trouble is never the request's
trouble: a store that is down, slow or returns bad data means a miss, and the engine computes.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import torch

from cleave.kv_store.block_hash import chain_hashes, salted_root
from cleave.kv_store.codec import HeaderWriter
from cleave.kv_store.store import BlockStore, EncodedBlock, StoredBlock, StoreUnavailable
from cleave.runtime.engine.async_engine import AsyncEngine, last_output
from cleave.runtime.engine.outputs import KVHandoff, RequestOutput
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.metrics import (
    KV_LOADED_BLOCKS,
    KV_RECOMPUTE_FALLBACKS,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_FAILURES,
    KV_TRANSFER_SECONDS,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


STORE_WARNING_INTERVAL_SECONDS = 10.0

# Blocks read through redis-py (Cluster, TLS) are read-only bytes, and torch warns when it views
# them; the views are only ever copied from. Set once here, not around each call: the tensors
# are made in the store's transfer threads, and catch_warnings is not thread-safe.
warnings.filterwarnings("ignore", message="The given buffer is not writable",
                        category=UserWarning)


class ThrottledWarning:
    """At most one warning per kind per interval; the ones in between are counted in the next.

    A Redis outage fails every request's store call: one line each would bury the log
    (thousands a second under load) while saying nothing new. The metrics count every one.
    """

    def __init__(self, logger: logging.Logger, interval_seconds: float) -> None:
        self.logger = logger
        self.interval = interval_seconds
        self._last: dict[str, float] = {}
        self._muted: dict[str, int] = {}

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._muted[kind] = self._muted.get(kind, 0) + 1
            return
        self._last[kind] = now
        muted = self._muted.pop(kind, 0)
        if muted and last is not None:
            message += f" ({muted} more like it in the last {now - last:.0f} s)"
        self.logger.warning("%s", message)


class KVBlocksMissing(RuntimeError):
    """Policy ``fail``: the prompt's blocks are not all in the store, and recompute is off."""


class KVStoreConnector:
    def __init__(self, engine: AsyncEngine, store: BlockStore, role: str = "both") -> None:
        self.engine = engine
        self.store = store
        self.role = role  # the metrics label
        core = engine.engine
        self.root_hash = core.root_hash
        self.block_size = core.config.block_size
        self.block_shape = core.block_shape
        self.dtype = core.dtype
        self.dtype_name = str(core.dtype).removeprefix("torch.")
        # Sealed with the store's MAC key: only holders of the service's salt write blocks
        # the workers accept.
        self._headers = HeaderWriter(self.dtype_name, self.block_shape, self.block_size,
                                     store.keys.mac_key)
        self._store_warnings = ThrottledWarning(log, STORE_WARNING_INTERVAL_SECONDS)
        # Exported at 0 from the start: a dashboard's failure panel then reads 0, not "No
        # data", and rate() has a sample to start from when the first failure comes.
        for direction in ("save", "load"):
            KV_TRANSFER_FAILURES.labels(role, direction)

    async def _transfer(self, direction: str, call: Awaitable[T],
                        nbytes: Callable[[T], int]) -> T | None:
        """Run one store call, measured; None when the store is unavailable (a miss)."""
        start = time.perf_counter()
        try:
            result = await call
        except StoreUnavailable as e:
            KV_TRANSFER_FAILURES.labels(self.role, direction).inc()
            self._store_warnings.warn(direction, f"KV {direction} skipped, the store is "
                                                 f"unavailable: {e}")
            return None
        KV_TRANSFER_SECONDS.labels(self.role, direction).observe(time.perf_counter() - start)
        KV_TRANSFER_BYTES.labels(self.role, direction).inc(nbytes(result))
        return result

    # -- write path ----------------------------------------------------------------------
    def encode(self, handoff: KVHandoff, skip: int = 0) -> list[EncodedBlock]:
        """Blocks whose headers go into the room the export left, written by the store as each
        block goes out (their checksums then cost no extra trip through memory): the payloads
        are not copied."""
        if handoff.buffer is None:
            raise ValueError("handoff was not exported with header room")
        rows = handoff.buffer.numpy()
        out = []
        for i in range(skip, len(handoff.block_hashes)):
            value, block_hash = rows[i].data, handoff.block_hashes[i]
            out.append(EncodedBlock(block_hash, value,
                                    seal=self._headers.deferred(value, block_hash)))
        return out

    async def save(self, handoff: KVHandoff, skip: int = 0) -> int:
        """Write blocks ``skip..`` to the store; returns how many were written (0 on trouble)."""
        blocks = self.encode(handoff, skip)
        if not blocks:
            return 0
        written = await self._transfer("save", self.store.put_many(blocks),
                                       lambda _: sum(b.nbytes for b in blocks))
        return written or 0

    # -- read path -----------------------------------------------------------------------
    def _tensor(self, block: StoredBlock) -> torch.Tensor | None:
        """The block as a tensor viewing its payload (None: another layout, not ours to
        load). Runs in the store's transfer thread as each block comes in."""
        h = block.header
        if h.dtype != self.dtype_name or h.shape != self.block_shape:
            return None
        return torch.frombuffer(block.payload, dtype=self.dtype).view(self.block_shape)

    async def load_prefix(self, prompt: list[int],
                          cache_salt: str | None = None) -> KVHandoff | None:
        """The prompt's longest cached prefix as a handoff, or None on a miss or trouble.
        Looked up under the request's ``cache_salt``: blocks of other salts are not found.

        The payloads stay views of the memory Redis's replies were received into: the one
        copy on this path is the engine's into its pool.
        """
        # The last token is always recomputed, so at most (n - 1) // block_size blocks matter.
        hashes = chain_hashes(salted_root(self.root_hash, cache_salt),
                              prompt[:len(prompt) - 1], self.block_size)
        if not hashes:
            return None
        tensors = await self._transfer("load", self.store.fetch_prefix_as(hashes, self._tensor),
                                       lambda found: sum(t.nbytes for t in found))
        if not tensors:
            return None
        return KVHandoff(block_hashes=hashes[:len(tensors)], blocks=tensors)

    # -- whole requests ------------------------------------------------------------------
    async def prefill(self, prompt: list[int], params: SamplingParams,
                      request_id: str | None = None) -> RequestOutput:
        """Prefill-only with the store: reuse its cached prefix, save the new full blocks.

        Returns the final output, whose ``handoff`` carries the first token and every full
        block (the decode side may take it directly or from the store).
        """
        cached = await self.load_prefix(prompt, params.cache_salt) \
            if params.reads_cached_prefix else None
        if cached:
            KV_LOADED_BLOCKS.labels("prefix").inc(len(cached.blocks))
        final = await last_output(self.engine.generate(prompt, params, request_id=request_id,
                                                       prefill_only=True, kv=cached))
        assert final.handoff is not None
        skip = len(cached.block_hashes) if cached else 0
        await self.save(final.handoff, skip=skip)
        return final

    async def decode(self, prompt: list[int], params: SamplingParams, first_token: int,
                     request_id: str | None = None, *, recompute_missing: bool = True,
                     earlier_tokens: tuple[int, ...] = ()
                     ) -> AsyncGenerator[RequestOutput, None]:
        """Continue a prefilled request with its KV from the store (``earlier_tokens``: the
        output a dropped decode had already handed out before ``first_token``).

        Missing blocks are recomputed, or with ``recompute_missing=False`` the request fails
        with :class:`KVBlocksMissing` before any token.
        """
        cached = await self.load_prefix(prompt, params.cache_salt)
        loaded = len(cached.blocks) if cached else 0
        KV_LOADED_BLOCKS.labels("decode").inc(loaded)
        if loaded < (len(prompt) - 1) // self.block_size:
            if not recompute_missing:
                raise KVBlocksMissing(
                    f"{loaded} of {(len(prompt) - 1) // self.block_size} KV blocks are in the "
                    "store and kv_load_failure_policy is 'fail'")
            KV_RECOMPUTE_FALLBACKS.inc()
        handoff = replace(cached, first_token=first_token, earlier_tokens=earlier_tokens) \
            if cached else KVHandoff(block_hashes=[], blocks=[], first_token=first_token,
                                     earlier_tokens=earlier_tokens)
        async for out in self.engine.generate(prompt, params, request_id=request_id, kv=handoff):
            yield out
