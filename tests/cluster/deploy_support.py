"""The walk-through of docs/operations.md ("Deploy on a cluster") as the e2e tests run it.

Each command the tests run is a line of that section's shell block (``doc_commands``), run with
the real helm and kubectl against the API emulator, whose pods the local node runs. The one
addition is ``--validate=false`` on ``kubectl apply``: the emulator serves no OpenAPI document.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "bin"
DOC = ROOT / "docs" / "operations.md"
SECTION = "## Deploy on a cluster"
T = TypeVar("T")


def doc_commands() -> list[str]:
    """The command lines of the walk-through's ```sh blocks (comments and blanks dropped,
    continuation lines joined)."""
    text = DOC.read_text()
    start = text.index(SECTION)
    # The walk-through ends at the next heading of any level: subsections after it (a hub
    # model, ...) are variations, not steps the test runs.
    end = text.find("\n##", start + len(SECTION))
    section = text[start:end if end > 0 else None]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = re.sub(r"\s+", " ", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


class Cluster:
    """kubectl and helm, as a user runs them, against the emulator at ``url``."""

    def __init__(self, url: str, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        config = home / "kubeconfig"
        config.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "local",
            "clusters": [{"name": "local", "cluster": {"server": url}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "me"}}],
            "users": [{"name": "me", "user": {}}]}))
        self.env = dict(os.environ, KUBECONFIG=str(config), HOME=str(home),
                        PATH=f"{TOOLS}:{os.environ['PATH']}")
        self.ran: list[str] = []

    def run(self, command: str, timeout: float = 120, check: bool = True) -> str:
        """One walk-through line, as written in the doc (a pipe is allowed)."""
        self.ran.append(command)
        shell = command
        if "kubectl apply" in shell:
            shell = shell.replace("kubectl apply", "kubectl apply --validate=false")
        done = subprocess.run(["bash", "-o", "pipefail", "-c", shell], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{command!r} exited {done.returncode}:\n{done.stderr}")
        return done.stdout

    def kubectl(self, *args: str, timeout: float = 60) -> str:
        """A kubectl call of the test's own (to look, not a walk-through step)."""
        done = subprocess.run([str(TOOLS / "kubectl"), *args], env=self.env, text=True,
                              capture_output=True, timeout=timeout)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def kubectl_apply(self, manifest: str) -> str:
        """Apply a manifest of the test's own (the user's other objects)."""
        done = subprocess.run([str(TOOLS / "kubectl"), "apply", "--validate=false", "-f", "-"],
                              env=self.env, text=True, input=manifest, capture_output=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))


def until(fn: Callable[[], T], timeout: float, why: Callable[[], str]) -> T:
    """Poll ``fn`` until truthy; on timeout fail with ``why()`` (the node's dump)."""
    deadline = time.monotonic() + timeout
    while not (result := fn()) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert result, f"{fn!r} stayed falsy for {timeout}s\n{why()}"
    return result
