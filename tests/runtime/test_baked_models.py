"""A runtime image bakes the converted default model (CLEAVE_MODEL_CACHE_PATH): a pod with an
empty cache loads it from there instead of converting it again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cleave.runtime.models import loader


def test_a_baked_conversion_is_used_and_nothing_is_converted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not really a gguf")
    digest = "ab" * 32
    baked = tmp_path / "baked" / f"model-{digest[:16]}"
    baked.mkdir(parents=True)
    (baked / loader._MARKER).write_text(json.dumps({"sha256": digest}))
    empty = tmp_path / "cache"
    monkeypatch.setenv(loader.MODEL_CACHE_PATH_ENV, f"/nowhere:{tmp_path / 'baked'}")
    assert loader._convert_gguf(gguf, digest, empty, print) == baked
    assert not empty.exists()  # nothing written, nothing converted
    monkeypatch.setenv(loader.MODEL_CACHE_PATH_ENV, "")
    with pytest.raises(Exception):  # noqa: B017  (no bake: it would convert this non-GGUF)
        loader._convert_gguf(gguf, digest, empty, lambda _: None)
