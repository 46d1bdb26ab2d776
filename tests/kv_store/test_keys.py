"""Redis keys: versioned, namespaced, bound to the fingerprint; patterns match their own only."""

from __future__ import annotations

import fnmatch
import itertools

import pytest

from cleave.kv_store.block_hash import KVFingerprint, chain_hashes
from cleave.kv_store.keys import KEY_PREFIX, KeySpace


def fingerprint(**overrides: object) -> KVFingerprint:
    fields: dict[str, object] = {"model_name": "tiny-llama", "weights_digest": "sha256:abc",
                                 "dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 2,
                                 "head_dim": 16, "block_size": 16, "salt": ""}
    fields.update(overrides)
    return KVFingerprint(**fields)  # type: ignore[arg-type]


FP = fingerprint()
TOKENS = list(range(1000, 1064))


def glob_match(pattern: bytes, key: bytes) -> bool:
    """Redis' glob: fnmatchcase with backslash escapes turned into one-char classes."""
    text = pattern.decode()
    out = ""
    i = 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            out += f"[{text[i + 1]}]"
            i += 2
        else:
            out += text[i]
            i += 1
    return fnmatch.fnmatchcase(key.decode(), out)


def test_key_carries_version_prefix_namespace_and_fingerprint() -> None:
    ks = KeySpace("svc-a", FP.root_hash())
    h = chain_hashes(FP.root_hash(), TOKENS, 16)[0]
    key = ks.block_key(h)
    assert isinstance(key, bytes)
    assert key.startswith(b"cleave:v1:")
    assert KEY_PREFIX == "cleave:v1"
    parts = key.split(b":")
    assert parts == [b"cleave", b"v1", b"svc-a", FP.root_hash()[:8].hex().encode(),
                     h.hex().encode()]
    assert key.startswith(ks.prefix)


def test_distinct_blocks_have_distinct_keys() -> None:
    ks = KeySpace("svc", FP.root_hash())
    hashes = chain_hashes(FP.root_hash(), TOKENS, 16)
    assert len({ks.block_key(h) for h in hashes}) == len(hashes)


def test_two_namespaces_never_collide() -> None:
    namespaces = ["a", "a-b", "a.b", "a_b", "ab", "A", "svc", "svc1", "svc-1", "1"]
    h = chain_hashes(FP.root_hash(), TOKENS, 16)[0]
    spaces = [KeySpace(ns, FP.root_hash()) for ns in namespaces]
    keys = [ks.block_key(h) for ks in spaces]
    assert len(set(keys)) == len(keys)
    prefixes = [ks.prefix for ks in spaces]
    for p, q in itertools.permutations(prefixes, 2):
        assert not q.startswith(p)  # no namespace's keys sit under another's prefix


def test_two_fingerprints_never_collide() -> None:
    variants = [fingerprint(), fingerprint(salt="tenant-b"), fingerprint(dtype="float16"),
                fingerprint(block_size=32), fingerprint(weights_digest="sha256:abd"),
                fingerprint(num_layers=3), fingerprint(model_name="other")]
    spaces = [KeySpace("svc", fp.root_hash()) for fp in variants]
    assert len({ks.prefix for ks in spaces}) == len(spaces)
    # The same tokens under two fingerprints: different chains and different keys.
    keys = set()
    for fp, ks in zip(variants, spaces, strict=True):
        keys.update(ks.block_key(h) for h in chain_hashes(fp.root_hash(), TOKENS, 16))
    assert len(keys) == 4 * len(variants)


@pytest.mark.parametrize("namespace", ["", "-lead", ".lead", "_lead", "has space", "a:b",
                                       "a*", "a?", "a[b]", "a\\b", "a/b", "é", "x" * 129,
                                       "line\nbreak", "a\n"])
def test_invalid_namespaces_are_rejected(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        KeySpace(namespace, FP.root_hash())


@pytest.mark.parametrize("namespace", ["a", "A9", "svc-a", "tenant_1.prod", "x" * 128])
def test_valid_namespaces_are_accepted(namespace: str) -> None:
    assert KeySpace(namespace, FP.root_hash()).namespace == namespace


@pytest.mark.parametrize("root", [b"", b"\x00" * 8, b"\x00" * 31, b"\x00" * 33])
def test_fingerprint_root_must_be_a_sha256_digest(root: bytes) -> None:
    with pytest.raises(ValueError, match="32-byte"):
        KeySpace("svc", root)


def test_namespace_pattern_matches_own_keys_across_fingerprints_only() -> None:
    h = chain_hashes(FP.root_hash(), TOKENS, 16)[1]
    own = KeySpace("svc", FP.root_hash())
    own_other_fp = KeySpace("svc", fingerprint(salt="x").root_hash())
    others = [KeySpace(ns, FP.root_hash()) for ns in ("svc-2", "svc.x", "sv", "svcs", "Svc")]
    pattern = own.namespace_pattern()
    assert pattern == b"cleave:v1:svc:*"
    assert glob_match(pattern, own.block_key(h))
    assert glob_match(pattern, own_other_fp.block_key(h))
    for ks in others:
        assert not glob_match(pattern, ks.block_key(h)), ks.namespace
        assert glob_match(ks.namespace_pattern(), ks.block_key(h))
    for foreign in (b"cleave:v2:svc:00:11", b"other:cleave:v1:svc:00", b"svc:cleave:v1:x"):
        assert not glob_match(pattern, foreign)


def test_keyspace_is_hashable_and_immutable() -> None:
    ks = KeySpace("svc", FP.root_hash())
    assert ks == KeySpace("svc", FP.root_hash())
    assert len({ks, KeySpace("svc", FP.root_hash())}) == 1
    with pytest.raises(AttributeError):
        ks.namespace = "other"  # type: ignore[misc]
