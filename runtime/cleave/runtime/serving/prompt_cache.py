"""What the router knows of the workers' cached KV for a prompt, under its ``cache_salt``.

Two uses: the prompt's first block hash picks the prefill worker whose prefix cache likely
holds it (prefix affinity), and a look-up in the store (STRLEN only: the router's Redis user
can do no more) says how much of the prompt is cached, which decides whether a separate prefill
pays. Both hash the prompt under the request's salt (block_hash.salted_root), exactly as the
workers do, so a request never learns of, nor is routed by, another salt's blocks.
"""

from __future__ import annotations

from dataclasses import replace

from cleave.kv_store.block_hash import chain_hashes, salted_root
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.kv_store.store import StoreUnavailable
from cleave.runtime.serving.fleet import Fleet

LOOKUP_TIMEOUT_SECONDS = 0.2  # a routing hint: never worth holding a request for


class PromptCache:
    def __init__(self, fleet: Fleet, store_config: RedisStoreConfig | None) -> None:
        self.fleet = fleet
        self.store_config = store_config
        self._store: RedisBlockStore | None = None

    def prefix_key(self, ids: list[int], salt: str | None) -> bytes:
        """The prompt's first block hash: prompts sharing it share a prefill worker's cache."""
        identity = self.fleet.decode.kv_identity or self.fleet.prefill.kv_identity
        if identity is not None and len(ids) >= identity[1]:
            root, block_size, _ = identity
            return chain_hashes(salted_root(bytes.fromhex(root), salt), ids[:block_size],
                                block_size)[0]
        return f"{salt}:{ids[:16]}".encode()

    async def cached_tokens(self, ids: list[int], salt: str | None) -> int:
        """How many leading prompt tokens the store already holds (0 when it cannot say)."""
        identity = self.fleet.decode.kv_identity
        if self.store_config is None or identity is None:
            return 0
        root, block_size, namespace = identity
        if self._store is None or self._store.keys.namespace != namespace:
            self._store = RedisBlockStore(
                KeySpace(namespace, bytes.fromhex(root)),
                replace(self.store_config, timeout_seconds=LOOKUP_TIMEOUT_SECONDS))
        hashes = chain_hashes(salted_root(bytes.fromhex(root), salt), ids[:len(ids) - 1],
                              block_size)
        try:
            return block_size * await self._store.longest_cached_prefix(hashes)
        except StoreUnavailable:
            return 0

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
