"""Shared fixtures: a tiny random Llama (seconds) and, for slow tests, the real default model."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_model import build_tiny_llama  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
