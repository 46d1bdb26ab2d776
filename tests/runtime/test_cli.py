"""The ``cleave`` command as a user runs it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from cleave.common.cli import BY_NAME, COMMANDS, Command, build_parser, main

CLEAVE = [sys.executable, "-m", "cleave.common.cli"]


def test_help_lists_generate() -> None:
    out = subprocess.run([*CLEAVE, "--help"], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout


def test_generate_prints_text_and_progress(tiny_model_dir: Path) -> None:
    out = subprocess.run(
        [*CLEAVE, "generate", "--model", str(tiny_model_dir), "--dtype", "float32",
         "--prompt", "hello world", "--max-tokens", "8", "--kv-cache-memory", "4MiB"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "loading model" in out.stderr and "model ready" in out.stderr
    assert "tokens in" in out.stderr
    assert out.stdout.strip(), "generated text goes to stdout"


def test_generate_reports_a_missing_model_clearly(tmp_path: Path) -> None:
    out = subprocess.run([*CLEAVE, "generate", "--model", str(tmp_path / "missing"),
                          "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "not found" in out.stderr
    assert "Traceback" not in out.stderr


def _imports_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}; import sys; print(*sys.modules)"],
                         capture_output=True, text=True, check=True, timeout=60)
    return {m.partition(".")[0] if not m.startswith("cleave.") else m
            for m in out.stdout.split()}


def test_help_imports_no_subcommand() -> None:
    # `cleave --help` must answer in every image: it lists the subcommands by name alone.
    loaded = _imports_after("import cleave.common.cli as c; c.build_parser(load=())")
    assert not loaded & {"torch", "transformers", "kopf", "kubernetes", "aiohttp", "matplotlib"}
    assert not {m for m in loaded if m.startswith(("cleave.runtime", "cleave.operator",
                                                   "cleave.autoscaling"))}


def test_the_operator_command_does_not_import_torch_and_the_worker_not_kopf() -> None:
    # The operator image ships without torch, the runtime image without kopf
    # (tools/check_images.py proves it in venvs that lack them).
    operator = _imports_after("import cleave.common.cli as c; c.build_parser(load=['operator']); "
                              "import cleave.operator.handlers")
    assert not operator & {"torch", "transformers", "cleave.runtime"}
    worker = _imports_after("import cleave.common.cli as c; "
                            "c.build_parser(load=['worker', 'router', 'up', 'generate'])")
    assert not worker & {"kopf", "kubernetes"}
    assert not {m for m in worker if m.startswith("cleave.operator")}


def test_every_subcommand_has_help() -> None:
    for command in BY_NAME:
        out = subprocess.run([*CLEAVE, command, "--help"], capture_output=True, text=True,
                             check=True)
        assert "usage: cleave " + command in out.stdout


def test_the_listing_says_what_each_subcommand_says_of_itself() -> None:
    listing = build_parser(load=())
    full = build_parser()
    assert _helps(listing) == _helps(full)
    assert list(_helps(full)) == [c.name for c in COMMANDS]


def _helps(parser: argparse.ArgumentParser) -> dict[str, str | None]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.help for a in sub._choices_actions}


def test_a_subcommand_whose_extra_is_missing_says_which_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def adder(_: object) -> None:
        raise ModuleNotFoundError("No module named 'kopf'", name="kopf")

    monkeypatch.setattr(Command, "load", lambda self: adder)
    assert main(["operator", "--help"]) == 2
    err = capsys.readouterr().err
    assert "cleave operator" in err and "pip install 'cleave[operator]'" in err


def test_a_missing_cleave_module_is_a_bug_not_a_missing_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def adder(_: object) -> None:
        raise ModuleNotFoundError("No module named 'cleave.nope'", name="cleave.nope")

    monkeypatch.setattr(Command, "load", lambda self: adder)
    with pytest.raises(ModuleNotFoundError):
        main(["worker"])
