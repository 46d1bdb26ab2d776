"""Block identity: the one definition of which KV block a run of tokens is.

The engine's prefix cache and the store's keys both call :func:`chain_hashes`, so every process
on every node agrees on a block's identity. Python's ``hash()`` is never used: it is salted per
process, which is exactly the bug that makes other KV connectors miss across processes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

DEFAULT_BLOCK_SIZE = 16
HASH_BYTES = 32


@dataclass(frozen=True)
class KVFingerprint:
    """Everything that makes two KV tensors for the same tokens incompatible.

    Two processes share blocks only when every field agrees: model identity (name and a digest
    of the weights), the activation dtype, the KV layout, the block size, and a per-service or
    per-tenant salt so one service can never read another's blocks.
    """

    model_name: str
    weights_digest: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = DEFAULT_BLOCK_SIZE
    salt: str = ""

    def canonical_bytes(self) -> bytes:
        # Sorted-key JSON is stable across Python versions and processes.
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def root_hash(self) -> bytes:
        """``h_0`` of every chain under this fingerprint."""
        return hashlib.sha256(self.canonical_bytes()).digest()


def salted_root(root: bytes, cache_salt: str | None) -> bytes:
    """The chain root of a request with vLLM's per-request ``cache_salt``.

    Salting the root changes every block hash of the request, so requests with different salts
    share no block (in an engine's prefix cache or in the store, whose keys are the hashes),
    while requests with the same salt share them as usual. No salt: the service's own root.
    """
    if not cache_salt:
        return root
    return hashlib.sha256(root + b"cache_salt\x00" + cache_salt.encode()).digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # Fixed-width little-endian uint32: identical bytes on every platform.
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def next_block_hash(parent: bytes, block_token_ids: Sequence[int]) -> bytes:
    """``h_i = sha256(h_{i-1} || token_ids_i)``."""
    return hashlib.sha256(parent + _token_bytes(block_token_ids)).digest()


def chain_hashes(
    root: bytes, token_ids: Sequence[int], block_size: int, *, start_parent: bytes | None = None
) -> list[bytes]:
    """Hashes of every *full* block of ``token_ids``; a trailing partial block has none.

    ``start_parent`` continues an existing chain (the hash of the block before ``token_ids``).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = root if start_parent is None else start_parent
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = next_block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
