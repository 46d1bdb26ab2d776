"""Each supported family token for token against transformers, fp32, on a tiny random model of
that family, through the real engine: paged pool, chunked prefill, batched decode, generating
past the sliding window where the family has one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from family_models import FAMILIES, WINDOW, build_family_model, engine_and_reference

from cleave.runtime.models.loader import ModelFiles, ModelLoadError, load_config


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(family: str, tmp_path: Path) -> None:
    ours, theirs = engine_and_reference(build_family_model(family, tmp_path / family))
    assert ours == theirs
    # Past a window (prompt + output) and not one repeated token: the check has teeth.
    assert max(len(p) for p in ours) + 41 > 2 * WINDOW
    assert any(len(set(tokens)) > 3 for tokens in ours)


def test_soft_capped_logprobs_match_transformers(tmp_path: Path) -> None:
    # A final logit soft-cap never changes the greedy token, only the distribution: check it.
    import torch
    from transformers import AutoModelForCausalLM

    from cleave.runtime.engine.config import EngineConfig
    from cleave.runtime.engine.llm_engine import LLMEngine
    from cleave.runtime.engine.sequence import SamplingParams

    directory = build_family_model("gemma2", tmp_path / "gemma2")
    engine = LLMEngine(EngineConfig(model=str(directory), dtype="float32", device="cpu",
                                    kv_cache_bytes=1 << 21, block_size=4),
                       progress=lambda _: None)
    prompt = list(range(3, 33))
    [result] = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True,
                                                        logprobs=3))
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + result.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits.float(), -1)
    for step, lp in enumerate(result.logprobs):
        assert lp.logprob == pytest.approx(float(ref[step, lp.token_id]), abs=1e-4)


def _variant(source: Path, target: Path, **changes: object) -> ModelFiles:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return ModelFiles(target, target.name, "0")


@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_model("llama3", tmp_path_factory.mktemp("families") / "llama3")


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}},
     "rope scaling 'longrope' is not supported"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},
     "quantization 'awq' is not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]},
     "'LlamaForSequenceClassification' is not a causal language model"),
    ({"hidden_act": "relu2"}, "activation 'relu2' is not supported"),
    ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]},
     "unsupported architecture 't5': no family reads it and transformers has no causal LM"),
])
def test_unservable_configs_name_what_is_missing(tiny_llama3: Path, tmp_path: Path,
                                                 changes: dict[str, object], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_config(_variant(tiny_llama3, tmp_path / "variant", **changes))


def test_vision_language_model_is_refused_naming_the_vision_tower(tmp_path: Path) -> None:
    from transformers import Gemma3Config

    (tmp_path / "vlm").mkdir()
    Gemma3Config().save_pretrained(tmp_path / "vlm")
    with pytest.raises(ModelLoadError, match="vision tower"):
        load_config(ModelFiles(tmp_path / "vlm", "vlm", "0"))


def test_family_registry_is_torch_free() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; "
            "from cleave.runtime.engine.families.registry import SUPPORTED_MODEL_TYPES; "
            "print(sorted(SUPPORTED_MODEL_TYPES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "gemma3_text" in out and "phi3" in out
