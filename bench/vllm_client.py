"""vLLM's CPU build beside bench/engine.py: bench/vllm_engine.py run under .venv-vllm's python
(``make vllm-env``), fed JSON commands over a pipe, one reply a line."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"


class VllmProcess:
    """bench/vllm_engine.py in the vLLM venv: one JSON command a line in, one JSON reply out."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, core: int) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS="1")
        # vLLM logs a lot: to a file, so a full pipe never stalls it.
        self.log_path = Path(tempfile.gettempdir()) / f"cleave-bench-vllm-{os.getpid()}.log"
        with self.log_path.open("w") as log_file:
            self.proc = subprocess.Popen(
                [str(VLLM_PYTHON), str(Path(__file__).parent / "vllm_engine.py"),
                 "--model", str(model_dir), "--dtype", str(dtype).removeprefix("torch.")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                text=True, env=env)
        self.ready: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"vLLM exited ({self.proc.wait()}; log {self.log_path}): {tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def wait_ready(self) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._read()
        return self.ready

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: _read says how
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_vllm(mode: str, quick: bool, model_dir: Path, dtype: torch.dtype,
               core: int | None, log: Callable[[str], None]) -> tuple[VllmProcess | None, str]:
    """(the running helper or None, what the JSON's ``vllm`` says)."""
    if mode == "off" or (quick and mode == "auto"):
        return None, "skipped"
    if not VLLM_PYTHON.exists():
        log(f"vLLM: absent ({VLLM_PYTHON} not found; `make vllm-env` creates it): "
            "no vLLM figures this run")
        return None, "absent"
    core = max(os.sched_getaffinity(0)) if core is None else core
    log(f"vLLM: starting {VLLM_PYTHON.parent.parent.name}'s vLLM on {model_dir}; its model "
        f"worker is one OpenMP thread bound to core {core}, its other processes "
        "OMP_NUM_THREADS=1, unpinned")
    process = VllmProcess(model_dir, dtype, core)
    log(f"vLLM: its log is {process.log_path}")
    return process, "started"
