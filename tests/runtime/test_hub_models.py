"""Hub ids as model sources, against a local server that answers as the Hugging Face hub does
(tests/hub_server.py; ``HF_ENDPOINT``): resolve, download only what is needed, pin revisions,
load .bin checkpoints, work offline from the cache, fail clearly, and serve through
``cleave up``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from hub_server import FakeHub
from redis_servers import free_port
from safetensors.torch import load_file
from tiny_model import build_tiny_llama

from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.models.loader import ModelLoadError, check_model, resolve_model
from cleave.runtime.serving.up import said_port

TOKEN = "hf_test_token"
EXTRAS = {"README.md": b"# tiny\n", "consolidated.safetensors": b"not needed",
          "pytorch_model.bin": b"not needed either", "onnx/model.onnx": b"nor this"}


def _support(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()
            if p.is_file() and p.suffix != ".safetensors"}


@pytest.fixture(scope="module")
def hub(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    other = build_tiny_llama(tmp_path_factory.mktemp("tiny-seed1"), seed=1)
    bin_state = load_file(str(tiny_model_dir / "model.safetensors"))
    bin_dir = tmp_path_factory.mktemp("bin")
    torch.save(bin_state, bin_dir / "pytorch_model.bin")
    with FakeHub() as h:
        h.add_directory("org/tiny", other, ref="v1")  # an older commit, tagged
        h.add_directory("org/tiny", tiny_model_dir, extra=EXTRAS)  # main
        h.add_commit("org/tiny-bin", {**_support(tiny_model_dir),
                                      "pytorch_model.bin": (bin_dir / "pytorch_model.bin")
                                      .read_bytes(), "README.md": b"bin only"})
        h.add_commit("org/no-weights", {"config.json": b"{}", "README.md": b"empty"})
        h.add_directory("org/gated", tiny_model_dir)
        h.repos["org/gated"].gated_token = TOKEN
        yield h


@pytest.fixture
def env(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The hub's URL and an empty Cleave cache; returns the cache."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("CLEAVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "")  # restored after the test, whoever sets it
    hub.requests.clear()
    return tmp_path / "cache"


def _engine(model: str, cache: Path, revision: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, revision=revision, cache_dir=cache,
                                  dtype="float32", device="cpu", kv_cache_bytes=8 << 20),
                     progress=lambda _: None)


def _greedy(engine: LLMEngine) -> list[int]:
    [out] = engine.generate(["the cat reads a long letter"],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return out.token_ids


def test_hub_model_generates_as_the_same_directory(env: Path, hub: FakeHub,
                                                   tiny_model_dir: Path) -> None:
    engine = _engine("org/tiny", env)
    local = _engine(str(tiny_model_dir), env)
    assert _greedy(engine) == _greedy(local)
    # Same weight bytes, same identity: the hub's LFS sha256s combine as a directory's do.
    assert engine.model_files.weights_digest == local.model_files.weights_digest
    assert engine.model_files.name == "org/tiny"


def test_only_the_needed_files_are_downloaded(env: Path, hub: FakeHub) -> None:
    files = resolve_model("org/tiny", env, progress=lambda _: None)
    wanted = {"config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "chat_template.jinja", "model.safetensors"}
    assert {p.name for p in files.directory.iterdir()} == wanted
    assert set(hub.downloads()) == wanted  # no README, consolidated, .bin or onnx fetched
    blobs = list((env / "hub" / "models--org--tiny" / "blobs").iterdir())
    assert len(blobs) == len(wanted)


def test_revision_pins_the_commit(env: Path, hub: FakeHub) -> None:
    repo = hub.repos["org/tiny"]
    main = resolve_model("org/tiny", env, progress=lambda _: None)
    tagged = resolve_model("org/tiny", env, progress=lambda _: None, revision="v1")
    by_sha = resolve_model("org/tiny", env, progress=lambda _: None,
                           revision=repo.refs["v1"])
    assert main.directory.name == repo.refs["main"]
    assert tagged.directory == by_sha.directory and tagged.directory.name == repo.refs["v1"]
    assert tagged.weights_digest != main.weights_digest  # different weights (seed 1)
    assert (tagged.directory / "README.md").exists() is False


def test_bin_only_repo_loads(env: Path, tiny_model_dir: Path) -> None:
    engine = _engine("org/tiny-bin", env)
    assert [p.name for p in engine.model_files.directory.glob("*.bin")] == ["pytorch_model.bin"]
    assert _greedy(engine) == _greedy(_engine(str(tiny_model_dir), env))


def test_second_resolve_needs_no_hub(env: Path, hub: FakeHub,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    first = resolve_model("org/tiny", env, progress=lambda _: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    again = resolve_model("org/tiny", env, progress=lambda _: None)
    assert again == first and hub.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    # The hub gone (connection refused): the cache serves, with a note.
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    notes: list[str] = []
    assert resolve_model("org/tiny", env, progress=notes.append) == first
    assert any("unreachable" in n for n in notes)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        resolve_model("org/tiny-bin", env, progress=lambda _: None)


@pytest.mark.parametrize(("model", "revision", "message"), [
    ("org/missing", None, "not found on .* not a local path"),
    ("org/gated", None, "gated.*HF_TOKEN"),
    ("org/tiny", "no-such-branch", "no revision 'no-such-branch'"),
    ("org/no-weights", None, "no weights.*README.md"),
])
def test_clear_errors(env: Path, model: str, revision: str | None, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(model, env, progress=lambda _: None, revision=revision)


def test_gated_repo_with_token(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    files = resolve_model("org/gated", env, progress=lambda _: None)
    assert (files.directory / "model.safetensors").exists()


def test_check_downloads_no_weights(env: Path, hub: FakeHub,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    said = check_model("org/tiny", "v1")
    assert hub.repos["org/tiny"].refs["v1"][:12] in said and "safetensors" in said
    assert hub.downloads() == [] and not env.exists()
    with pytest.raises(ModelLoadError, match="not found"):
        check_model("org/missing")
    resolve_model("org/tiny", env, progress=lambda _: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "cached commit" in check_model("org/tiny")


def test_up_serves_a_hub_model(env: Path, hub: FakeHub, tmp_path: Path) -> None:
    """``cleave up --model org/tiny``: downloaded once, then every worker and the router load it
    from the cache; a request through the official client gets an answer."""
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cleave.common.cli", "up", "--model", "org/tiny",
         "--revision", "main", "--prefill", "0", "--dtype", "float32",
         "--kv-cache-memory", "8MiB", "--port", "0"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 180
        while (port := said_port(log.read_text())) is None:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               max_retries=0)
        reply = client.chat.completions.create(
            model="org/tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert [m.id for m in client.models.list()] == ["org/tiny"]
        weights = [d for d in hub.downloads() if d.endswith(".safetensors")]
        assert weights == ["model.safetensors"]  # once, by cleave up; the workers found it
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_download_command_fills_the_cache(env: Path, hub: FakeHub,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``cleave download`` (a pod's init container) leaves what a later offline start needs."""
    from cleave.common.cli import build_parser

    args = build_parser().parse_args(["download", "--model=org/tiny", "--revision=v1"])
    assert args.func(args) == 0
    snapshot = env / "hub" / "models--org--tiny" / "snapshots" / hub.repos["org/tiny"].refs["v1"]
    assert str(snapshot) in capsys.readouterr().out
    os.environ["HF_HUB_OFFLINE"] = "1"  # env's monkeypatch restores it
    assert resolve_model("org/tiny", env, lambda _: None, "v1").directory == snapshot
    args = build_parser().parse_args(["download", "--model=/models/x"])
    assert args.func(args) == 2
    assert "not a hub id" in capsys.readouterr().err
