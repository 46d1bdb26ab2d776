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


# --- Running the suite on several processes (`pytest -n N`, pytest-xdist; `make unit`) ---
# Most of the suite's wall time is spent waiting (on servers starting, timeouts, sleeps in
# fault tests), so a 2-core machine runs it faster on more processes than cores. Tests are
# handed out a file at a time, so a module's stack (its module-scoped fixtures: servers,
# clusters) starts once, on one process; a folder in ONE_PROCESS is handed out whole (the
# local node takes a machine-wide lock, and its tests run one node after another). Files go
# out in collection order (the scheduler below turns loadscope's reordering off), which puts the
# folders whose tests start processes first: the long files never form the tail while the
# other processes wait, and the quick unit tests fill in at the end.
FIRST = ("cluster", "reliability", "runtime", "charts", "kv_store")
ONE_PROCESS = ("tests/cluster/",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        folder = Path(item.path).relative_to(here).parts[0]
        return FIRST.index(folder) if folder in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: each file's tests stay together and in order


@pytest.hookimpl(optionalhook=True)  # the suite also runs without xdist (`-p no:xdist`)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # hand files out in collection order (above)

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((folder for folder in ONE_PROCESS if path.startswith(folder)), path)

    return FileScheduling(config, log)  # type: ignore[arg-type]
