"""Bad requests and bad models fail clearly, and leave the engine serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sequence import RequestError, SamplingParams
from cleave.runtime.models.loader import ModelLoadError


def test_empty_prompt(tiny_engine_factory) -> None:
    engine = tiny_engine_factory()
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("b", "", SamplingParams())
    assert not engine.has_unfinished


def test_prompt_beyond_max_model_len(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(max_model_len=64)
    with pytest.raises(RequestError, match="maximum context of 64"):
        engine.add_request("a", [5] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="exceeds"):
        engine.add_request("b", [5] * 60, SamplingParams(max_tokens=10))
    [ok] = engine.generate([[5] * 60], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(ok.token_ids) == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"logprobs": 99}, "logprobs"),
    ({"stop": ("",)}, "stop"),
])
def test_invalid_sampling_params(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_token_ids_outside_vocab(tiny_engine_factory) -> None:
    engine = tiny_engine_factory()
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("a", [1, 2, 10**6], SamplingParams())


def test_duplicate_request_id(tiny_engine_factory) -> None:
    engine = tiny_engine_factory()
    engine.add_request("same", [4, 5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("same", [4, 5, 6], SamplingParams(max_tokens=2))


def test_request_larger_than_the_pool(tiny_engine_factory) -> None:
    engine = tiny_engine_factory(kv_cache_bytes=4 * 8192)  # 4 blocks of 16 tokens
    with pytest.raises(RequestError, match="KV pool"):
        engine.add_request("a", [5] * 60, SamplingParams(max_tokens=10))


def test_unknown_model_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")), progress=lambda _: None)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)), progress=lambda _: None)


def test_unsupported_architecture(tiny_model_dir: Path, tmp_path: Path) -> None:
    # gpt2 runs on the generic path now (tests/runtime/test_generic.py); t5 has no causal LM.
    model = tmp_path / "t5ish"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "t5"
    config["architectures"] = ["T5ForConditionalGeneration"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 't5'"):
        LLMEngine(EngineConfig(model=str(model)), progress=lambda _: None)


def test_dtype_the_device_cannot_run(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float16", device="cpu"),
                  progress=lambda _: None)
    with pytest.raises(ValueError, match="unknown dtype"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="int3"), progress=lambda _: None)


def test_rope_scaling_that_varies_per_step_is_refused(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    # Sliding windows are served now (tests/runtime/test_families.py); dynamic NTK rope, whose
    # frequencies change with each forward's length, is not.
    model = tmp_path / "dynamic-rope"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="rope scaling 'dynamic' is not supported"):
        LLMEngine(EngineConfig(model=str(model)), progress=lambda _: None)
