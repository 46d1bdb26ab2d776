"""bench/engine.py's vLLM side, without vLLM: absent venv, --quick and --vllm off say so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_engine() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_engine_under_test", BENCH / "engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_absent_venv_is_said_plainly(bench_engine: ModuleType, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    client = sys.modules["vllm_client"]  # imported by engine.py
    monkeypatch.setattr(client, "VLLM_PYTHON", tmp_path / "missing" / "python")
    process, status = bench_engine.start_vllm("auto", False, tmp_path, torch.bfloat16, None,
                                              bench_engine.log)
    assert process is None and status == "absent"
    assert "vLLM: absent" in capsys.readouterr().err


def test_quick_and_off_skip_vllm(bench_engine: ModuleType, tmp_path: Path) -> None:
    for mode, quick in (("auto", True), ("off", False), ("off", True)):
        assert bench_engine.start_vllm(mode, quick, tmp_path, torch.bfloat16, None,
                                       bench_engine.log) == (None, "skipped")
