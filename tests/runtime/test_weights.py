"""Which files of a repository or directory are fetched and loaded: one weight format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cleave.runtime.models.weights import (
    NoWeightsError,
    load_weight_file,
    needed_names,
    weight_files,
    weight_names,
)

SUPPORT = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "tokenizer.model", "chat_template.jinja"]
NOISE = ["README.md", ".gitattributes", "original/consolidated.00.pth", "onnx/model.onnx",
         "training_args.bin", "flax_model.msgpack", "tf_model.h5"]


def test_shards_win_over_consolidated_and_bin() -> None:
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    names = [*SUPPORT, *NOISE, *shards, "model.safetensors.index.json",
             "consolidated.safetensors", "params.json", "pytorch_model.bin",
             "pytorch_model.bin.index.json"]
    assert weight_names(names) == tuple(shards)
    needed = needed_names(names)
    assert set(needed) == {*SUPPORT, *shards, "model.safetensors.index.json", "params.json"}
    assert "consolidated.safetensors" not in needed and "pytorch_model.bin.index.json" \
        not in needed


def test_consolidated_alone_is_taken() -> None:
    assert weight_names(["config.json", "consolidated.safetensors"]) == \
        ("consolidated.safetensors",)


def test_bin_only_when_no_safetensors() -> None:
    bins = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    names = [*SUPPORT, *NOISE, *bins, "pytorch_model.bin.index.json"]
    assert weight_names(names) == tuple(bins)  # training_args.bin is not a weight
    assert "pytorch_model.bin.index.json" in needed_names(names)


def test_no_weights() -> None:
    with pytest.raises(NoWeightsError):
        needed_names([*SUPPORT, *NOISE])


def test_bin_loads_with_weights_only(tmp_path: Path) -> None:
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    [path] = weight_files(tmp_path)
    loaded = load_weight_file(path)
    assert set(loaded) == {"a", "b"} and torch.equal(loaded["a"], state["a"])
    assert loaded["b"].dtype == torch.bfloat16


def test_bin_with_code_is_refused(tmp_path: Path) -> None:
    """A pickle that would run code (any object beyond tensors) does not load."""
    torch.save({"w": torch.ones(1), "evil": Path("/etc/passwd")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match=r"(?i)weights_only|unsupported|global"):
        load_weight_file(tmp_path / "pytorch_model.bin")
