"""End to end on a real Kubernetes cluster: install the chart, apply an example, wait for
Ready, send a completion through the router.

Not part of `make test` (no cluster exists in CI). Run it against any cluster where the
runtime and operator images are pullable:

    CLEAVE_E2E_KUBECONFIG=~/.kube/config \\
    CLEAVE_E2E_OPERATOR_IMAGE=ghcr.io/you/cleave-operator:dev \\
    CLEAVE_E2E_RUNTIME_IMAGE=ghcr.io/you/cleave-runtime:dev \\
    .venv/bin/pytest -q e2e/

(kind works: `kind create cluster`, then `kind load docker-image` both images built from
docker/.) Each run uses a fresh namespace and removes it afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBECONFIG = os.environ.get("CLEAVE_E2E_KUBECONFIG")
pytestmark = pytest.mark.skipif(not KUBECONFIG, reason="set CLEAVE_E2E_KUBECONFIG to run")
HELM = shutil.which("helm") or str(ROOT / ".tools/bin/helm")
KUBECTL = shutil.which("kubectl") or str(ROOT / ".tools/bin/kubectl")


def run(*cmd: str, timeout: float = 300) -> str:
    env = dict(os.environ, KUBECONFIG=os.path.expanduser(KUBECONFIG or ""))
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env,
                          timeout=timeout).stdout


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    ns = f"cleave-e2e-{uuid.uuid4().hex[:6]}"
    run(KUBECTL, "create", "namespace", ns)
    operator_image = os.environ["CLEAVE_E2E_OPERATOR_IMAGE"]
    repo, _, tag = operator_image.rpartition(":")
    run(HELM, "install", "cleave", str(ROOT / "charts/cleave"), "--namespace", ns,
        "--set", f"operator.image.repository={repo}", "--set", f"operator.image.tag={tag}",
        "--set", f"runtime.image={os.environ['CLEAVE_E2E_RUNTIME_IMAGE']}",
        "--set", f"operator.watchNamespaces={{{ns}}}", "--wait", timeout=600)
    try:
        yield ns
    finally:
        run(HELM, "uninstall", "cleave", "--namespace", ns)
        run(KUBECTL, "delete", "namespace", ns, "--wait=false")


def test_example_service_becomes_ready_and_serves(namespace: str) -> None:
    example = (ROOT / "examples/cpu-smollm2.yaml").read_text().replace(
        "namespace: default", f"namespace: {namespace}")
    name = yaml.safe_load(example)["metadata"]["name"]
    subprocess.run([KUBECTL, "apply", "-f", "-"], input=example, text=True, check=True,
                   env=dict(os.environ, KUBECONFIG=os.path.expanduser(KUBECONFIG or "")))
    run(KUBECTL, "wait", f"llmservice/{name}", "-n", namespace, "--for=condition=Ready",
        "--timeout=900s", timeout=960)
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4})
    out = run(KUBECTL, "run", f"probe-{uuid.uuid4().hex[:5]}", "-n", namespace, "--rm", "-i",
              "--restart=Never", "--image=curlimages/curl", "--", "curl", "-s",
              "-H", "Content-Type: application/json", "-d", body,
              f"http://{name}-router.{namespace}.svc:8000/v1/completions", timeout=300)
    reply = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert reply["usage"]["completion_tokens"] >= 1
