"""Which files of a model repository or directory the engine needs: configuration, tokenizer,
and ONE weight format.

The same choice serves a hub repository (its file list decides what is downloaded) and a local
directory (what is loaded and hashed), so a repository downloaded here loads exactly as the same
files in a directory would. Torch-free: the router and ``--check`` use it.
"""

from __future__ import annotations

import fnmatch
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# Everything transformers reads besides weights: config, generation config, tokenizer files of
# every kind (BPE, SentencePiece, tiktoken) and a chat template kept as its own file.
_SUPPORT_PATTERNS = ("*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt",
                     "*.jinja", "spiece.model")
_INDEXES = (SAFETENSORS_INDEX, BIN_INDEX)


class NoWeightsError(ValueError):
    """Neither safetensors nor pytorch_model*.bin weights among the files."""


def _top_level(names: Iterable[str]) -> list[str]:
    # Subfolders hold other formats (Llama's original/*.pth, onnx/, ...): never needed.
    return sorted(n for n in names if "/" not in n)


def weight_names(names: Iterable[str]) -> tuple[str, ...]:
    """The weight files to load, preferring safetensors.

    Mistral repositories ship both ``consolidated.safetensors`` (Mistral's own format) and the
    transformers shards ``model-*.safetensors``: only the shards are taken (downloading both
    doubles the bytes). ``pytorch_model*.bin`` only when no safetensors exist.
    """
    top = _top_level(names)
    safetensors = [n for n in top if n.endswith(".safetensors")]
    transformers_format = [n for n in safetensors if not n.startswith("consolidated")]
    if transformers_format or safetensors:
        return tuple(transformers_format or safetensors)
    bins = [n for n in top if fnmatch.fnmatch(n, "pytorch_model*.bin")]
    if bins:
        return tuple(bins)
    raise NoWeightsError("no weights: neither *.safetensors nor pytorch_model*.bin")


def needed_names(names: Iterable[str]) -> tuple[str, ...]:
    """Weights (one format) plus the configuration and tokenizer files, and the weights'
    own index only."""
    top = _top_level(names)
    weights = weight_names(top)
    own_index = BIN_INDEX if weights[0].endswith(".bin") else SAFETENSORS_INDEX
    support = [n for n in top if any(fnmatch.fnmatch(n, p) for p in _SUPPORT_PATTERNS)
               and (n not in _INDEXES or n == own_index)]
    return tuple(sorted({*weights, *support}))


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a local model directory (raises :class:`NoWeightsError`)."""
    names = [p.name for p in directory.iterdir() if p.is_file()]
    return [directory / n for n in weight_names(names)]


def load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    import torch

    # weights_only: a .bin is a pickle, and unpickling arbitrary objects runs arbitrary code.
    # mmap (zip format only, torch >= 1.6 writes it) avoids a second copy in memory.
    state = torch.load(path, map_location="cpu", weights_only=True,
                       mmap=zipfile.is_zipfile(path))
    if not isinstance(state, dict):
        raise ValueError(f"{path.name} holds no state dict")
    return state
