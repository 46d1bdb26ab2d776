"""The ``cleave`` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CLEAVE = [sys.executable, "-m", "cleave.runtime.cli"]


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


def test_the_cli_and_the_operator_command_do_not_import_torch() -> None:
    # The operator image ships without torch: `cleave operator` must start without it.
    code = ("import sys, cleave.runtime.cli as c; c.build_parser(); "
            "import cleave.operator.handlers; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_subcommand_has_help() -> None:
    for command in ("generate", "worker", "router", "up", "operator"):
        out = subprocess.run([*CLEAVE, command, "--help"], capture_output=True, text=True,
                             check=True)
        assert "usage: cleave " + command in out.stdout
