"""Redis keys for blocks: namespaced, versioned, and bound to the model fingerprint.

``cleave:v1:<namespace>:<fingerprint>:<block hash>``. The chain hash already covers the
fingerprint (model, weights, dtype, layout, block size, salt), so a block can only ever match
its own service's blocks; the namespace and fingerprint in the key also let an operator list
or delete one service's blocks without touching another's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

KEY_PREFIX = "cleave:v1"
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class KeySpace:
    namespace: str  # the service (LLMService name, tenant); never shared between services
    fingerprint_root: bytes  # KVFingerprint.root_hash()
    # The blocks' MAC key (codec.mac_key of the service's KV salt): what a store writes and
    # checks every value with. Empty: unkeyed checksums. Never printed.
    mac_key: bytes = field(default=b"", repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError(
                f"namespace {self.namespace!r} must be 1-128 chars of letters, digits, '.', "
                "'_' or '-', starting with a letter or digit")
        if len(self.fingerprint_root) != 32:
            raise ValueError("fingerprint_root must be a 32-byte sha256 digest")

    @cached_property
    def prefix(self) -> bytes:  # made once: every block key of every transfer starts with it
        return f"{KEY_PREFIX}:{self.namespace}:{self.fingerprint_root[:8].hex()}:".encode()

    def block_key(self, block_hash: bytes) -> bytes:
        return self.prefix + block_hash.hex().encode()

    def namespace_pattern(self) -> bytes:
        """Every key of this namespace, across fingerprints (glob-escaped)."""
        return namespace_pattern(self.namespace).encode()


def namespace_pattern(namespace: str) -> str:
    """The glob of every key of a namespace, across fingerprints: what SCAN matches, and what
    the managed Redis's ACL users may touch (operator/cleave/operator/redis_users.py)."""
    escaped = re.sub(r"([*?\[\]\\])", r"\\\1", namespace)
    return f"{KEY_PREFIX}:{escaped}:*"
