"""Shared fixtures: a tiny random Llama (seconds) and, for slow tests, the real default model."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from redis_servers import RedisServer, start_server
from tiny_model import build_tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server shared by a module's well-behaved tests (each uses its own
    namespace); a test that kills or pauses one starts its own."""
    server = start_server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """Build fp32 engines on the tiny model; keyword arguments override EngineConfig fields."""
    from cleave.runtime.engine.config import EngineConfig
    from cleave.runtime.engine.llm_engine import LLMEngine

    def make(**overrides: object) -> LLMEngine:
        fields: dict[str, object] = {"model": str(tiny_model_dir), "dtype": "float32",
                                     "kv_cache_bytes": 1 << 22}
        fields.update(overrides)
        return LLMEngine(EngineConfig(**fields), progress=lambda _: None)  # type: ignore[arg-type]

    return make


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
