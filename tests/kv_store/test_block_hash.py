"""Block identity: the chained block hash every process and node must agree on."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from cleave.kv_store.block_hash import (
    DEFAULT_BLOCK_SIZE,
    HASH_BYTES,
    KVFingerprint,
    chain_hashes,
    next_block_hash,
)

FP = KVFingerprint(
    model_name="tiny-llama",
    weights_digest="sha256:abc123",
    dtype="bfloat16",
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    block_size=4,
    salt="tenant-a",
)
TOKENS = list(range(100, 118))  # 4 full blocks of 4, plus a partial block of 2


def test_hashes_have_the_documented_shape() -> None:
    hashes = chain_hashes(FP.root_hash(), TOKENS, 4)
    assert len(hashes) == 4
    assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hashes)
    assert len(set(hashes)) == 4
    assert KVFingerprint("m", "d", "float16", 1, 1, 8).block_size == DEFAULT_BLOCK_SIZE


def test_matches_the_spec_byte_for_byte() -> None:
    # h_0 = sha256(fingerprint), h_i = sha256(h_{i-1} || uint32 little-endian token ids).
    root = FP.root_hash()
    assert root == hashlib.sha256(
        json.dumps(dataclasses.asdict(FP), sort_keys=True, separators=(",", ":")).encode()
    ).digest()
    expected = []
    parent = root
    for i in range(4):
        block = TOKENS[i * 4 : (i + 1) * 4]
        parent = hashlib.sha256(parent + struct.pack("<4I", *block)).digest()
        expected.append(parent)
    assert chain_hashes(root, TOKENS, 4) == expected
    assert next_block_hash(root, TOKENS[:4]) == expected[0]
    # Fixed width: token 1 followed by 0 is not token 256 (no variable-length encoding).
    assert next_block_hash(root, [1, 0]) != next_block_hash(root, [256])


def test_large_token_ids_are_encoded_not_truncated() -> None:
    root = FP.root_hash()
    assert next_block_hash(root, [2**32 - 1]) != next_block_hash(root, [2**16 - 1])
    with pytest.raises(struct.error):
        next_block_hash(root, [2**32])


_CHILD = """
import json
from cleave.kv_store.block_hash import KVFingerprint, chain_hashes
fp = KVFingerprint(**json.loads({fp!r}))
print(json.dumps({{
    "root": fp.root_hash().hex(),
    "chain": [h.hex() for h in chain_hashes(fp.root_hash(), {tokens!r}, 4)],
    "py_hash": hash("cleave"),
}}))
"""


def _hashes_in_subprocess(seed: str) -> dict[str, object]:
    code = _CHILD.format(fp=json.dumps(dataclasses.asdict(FP)), tokens=TOKENS)
    env = {**os.environ, "PYTHONHASHSEED": seed}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    parsed: dict[str, object] = json.loads(result.stdout)
    return parsed


def test_deterministic_across_processes_with_different_hash_seeds() -> None:
    a = _hashes_in_subprocess("1")
    b = _hashes_in_subprocess("2")
    # The two children really did disagree on Python's salted hash() ...
    assert a["py_hash"] != b["py_hash"]
    # ... yet agree with each other and with this process on every block hash.
    local = {
        "root": FP.root_hash().hex(),
        "chain": [h.hex() for h in chain_hashes(FP.root_hash(), TOKENS, 4)],
    }
    for child in (a, b):
        assert child["root"] == local["root"]
        assert child["chain"] == local["chain"]


@pytest.mark.parametrize("i", range(4))
def test_chain_property(i: int) -> None:
    root = FP.root_hash()
    base = chain_hashes(root, TOKENS, 4)
    changed = list(TOKENS)
    changed[i * 4 + 2] += 1
    new = chain_hashes(root, changed, 4)
    assert new[:i] == base[:i]
    for j in range(i, 4):
        assert new[j] != base[j]


def test_trailing_partial_block_has_no_hash() -> None:
    root = FP.root_hash()
    assert chain_hashes(root, TOKENS[:3], 4) == []
    assert chain_hashes(root, [], 4) == []
    assert len(chain_hashes(root, TOKENS[:7], 4)) == 1
    assert len(chain_hashes(root, TOKENS[:8], 4)) == 2
    # Tokens in the partial block do not influence the full blocks' hashes.
    assert chain_hashes(root, [*TOKENS[:16], 1, 2], 4) == chain_hashes(root, TOKENS[:16], 4)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_name", "other-llama"),
        ("weights_digest", "sha256:def456"),
        ("dtype", "float16"),
        ("num_layers", 3),
        ("num_kv_heads", 4),
        ("head_dim", 32),
        ("block_size", 8),
        ("salt", "tenant-b"),
    ],
)
def test_every_fingerprint_field_changes_the_root(field: str, value: object) -> None:
    other = dataclasses.replace(FP, **{field: value})  # type: ignore[arg-type]
    assert other.root_hash() != FP.root_hash()
    # And so every block under it differs too.
    a = chain_hashes(FP.root_hash(), TOKENS, 4)
    b = chain_hashes(other.root_hash(), TOKENS, 4)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_empty_salt_differs_from_a_salt() -> None:
    assert dataclasses.replace(FP, salt="").root_hash() != FP.root_hash()


def test_equal_fingerprints_share_a_root() -> None:
    assert dataclasses.replace(FP).root_hash() == FP.root_hash()


@pytest.mark.parametrize("split_blocks", [0, 1, 2, 3, 4])
def test_start_parent_continuation_equals_full_chain(split_blocks: int) -> None:
    root = FP.root_hash()
    full = chain_hashes(root, TOKENS, 4)
    head = chain_hashes(root, TOKENS[: split_blocks * 4], 4)
    parent = head[-1] if head else None
    tail = chain_hashes(root, TOKENS[split_blocks * 4 :], 4, start_parent=parent)
    assert head + tail == full


def test_start_parent_is_used_instead_of_root() -> None:
    root = FP.root_hash()
    other = b"\x01" * HASH_BYTES
    assert chain_hashes(root, TOKENS, 4, start_parent=other) != chain_hashes(root, TOKENS, 4)
    assert chain_hashes(root, TOKENS, 4, start_parent=root) == chain_hashes(root, TOKENS, 4)


def test_block_size_changes_the_chain() -> None:
    root = FP.root_hash()
    assert chain_hashes(root, TOKENS, 2)[1] != chain_hashes(root, TOKENS, 4)[0]
    assert len(chain_hashes(root, TOKENS, 2)) == 9


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_invalid_block_size_raises(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes(FP.root_hash(), TOKENS, block_size)


def test_accepts_tuples_and_lists_alike() -> None:
    root = FP.root_hash()
    assert chain_hashes(root, tuple(TOKENS), 4) == chain_hashes(root, TOKENS, 4)
