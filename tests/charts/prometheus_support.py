"""A real Prometheus (Debian's ``prometheus`` package) configured as the Prometheus Operator
configures it for a ServiceMonitor, scraping local processes in place of a cluster's pods.

What the Prometheus Operator and Kubernetes service discovery would contribute is done here,
as they document it: every endpoint of every Service becomes a target carrying the
``__meta_kubernetes_*`` labels of the endpoints role, and the ServiceMonitor becomes the
``relabel_configs`` the operator generates (keep on the selector's labels and on the endpoint's
port name, then the standard ``namespace``/``service``/``pod``/``container``/``job``/``endpoint``
labels, then the ServiceMonitor's own relabelings). Prometheus itself applies them, so a
selector, port name or relabeling that does not match what the operator builds drops the
target or the label, as it would in a cluster.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from redis_servers import free_port

PROMETHEUS = shutil.which("prometheus")
Obj = dict[str, Any]


def _label(name: str) -> str:
    """A Kubernetes label key as a Prometheus label name (service discovery's sanitizing)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def targets(children: list[Obj], addresses: Mapping[str, str]) -> list[Obj]:
    """Kubernetes SD (role endpoints) over built children: one target per Service port per pod
    template the Service selects, at ``addresses[component]`` (the local process standing in
    for that pod; a component without one gets an address nothing listens on)."""
    workloads = [c for c in children if c["kind"] in ("Deployment", "StatefulSet")]
    out = []
    for svc in (c for c in children if c["kind"] == "Service"):
        meta, spec = svc["metadata"], svc["spec"]
        svc_labels = meta.get("labels") or {}
        for workload in workloads:
            template = workload["spec"]["template"]
            pod_labels = template["metadata"].get("labels") or {}
            if not _selects(spec.get("selector") or {}, pod_labels):
                continue
            component = pod_labels.get("app.kubernetes.io/component", "")
            for port in spec.get("ports") or []:
                labels = {
                    "__meta_kubernetes_namespace": meta["namespace"],
                    "__meta_kubernetes_service_name": meta["name"],
                    "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_name": f"{workload['metadata']['name']}-0",
                    "__meta_kubernetes_pod_container_name":
                        template["spec"]["containers"][0]["name"],
                    **{f"__meta_kubernetes_service_label_{_label(k)}": v
                       for k, v in svc_labels.items()},
                    **{f"__meta_kubernetes_service_labelpresent_{_label(k)}": "true"
                       for k in svc_labels},
                    **{f"__meta_kubernetes_pod_label_{_label(k)}": v
                       for k, v in pod_labels.items()}}
                out.append({"targets": [addresses.get(component, "127.0.0.1:9")],
                            "labels": labels})
    return out


def _selector_rules(selector: Mapping[str, Any]) -> list[Obj]:
    rules: list[Obj] = []
    for key, value in (selector.get("matchLabels") or {}).items():
        rules.append({"action": "keep", "regex": f"({value});true", "source_labels": [
            f"__meta_kubernetes_service_label_{_label(key)}",
            f"__meta_kubernetes_service_labelpresent_{_label(key)}"]})
    for expr in selector.get("matchExpressions") or []:
        key, op = _label(expr["key"]), expr["operator"]
        value_labels = [f"__meta_kubernetes_service_label_{key}",
                        f"__meta_kubernetes_service_labelpresent_{key}"]
        if op in ("In", "NotIn"):
            rules.append({"action": "keep" if op == "In" else "drop",
                          "regex": f"({'|'.join(expr['values'])});true",
                          "source_labels": value_labels})
        else:  # Exists / DoesNotExist
            rules.append({"action": "keep" if op == "Exists" else "drop", "regex": "true",
                          "source_labels": [value_labels[1]]})
    return rules


def _relabeling(r: Mapping[str, Any]) -> Obj:
    """A ServiceMonitor relabeling (camelCase) as a Prometheus relabel_config."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label",
            "regex": "regex", "replacement": "replacement", "separator": "separator",
            "modulus": "modulus"}
    out = {keys[k]: v for k, v in r.items() if k in keys}
    out["action"] = str(r.get("action", "replace")).lower()
    return out


def scrape_config(monitor: Obj, interval: str = "1s") -> list[Obj]:
    """One scrape job per ServiceMonitor endpoint, as the Prometheus Operator generates it
    (its ``interval`` replaced by ``interval``: the test cannot wait 15 s per scrape; the
    Kubernetes service discovery by file discovery, which :func:`prometheus` adds)."""
    spec, meta = monitor["spec"], monitor["metadata"]
    jobs = []
    for i, endpoint in enumerate(spec["endpoints"]):
        rules = [*_selector_rules(spec["selector"]),
                 {"action": "keep", "regex": endpoint["port"],
                  "source_labels": ["__meta_kubernetes_endpoint_port_name"]}]
        for target, source in (("namespace", "namespace"), ("service", "service_name"),
                               ("pod", "pod_name"), ("container", "pod_container_name"),
                               ("job", "service_name")):
            rules.append({"source_labels": [f"__meta_kubernetes_{source}"],
                          "target_label": target})
        rules.append({"target_label": "endpoint", "replacement": endpoint["port"]})
        rules += [_relabeling(r) for r in endpoint.get("relabelings") or []]
        jobs.append({"job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{i}",
                     "honor_labels": False, "scrape_interval": interval,
                     "metrics_path": endpoint.get("path", "/metrics"),
                     "relabel_configs": rules})
    return jobs


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as r:
            answer = json.load(r)
        assert answer["status"] == "success", answer
        return answer

    def vector(self, promql: str) -> list[Obj]:
        data = self.api("query", query=promql)["data"]
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def active_targets(self) -> list[Obj]:
        return list(self.api("targets")["data"]["activeTargets"])


@contextmanager
def prometheus(workdir: Path, jobs: list[Obj], sd: list[Obj]) -> Iterator[Prometheus]:
    """Run the real binary on ``jobs`` with ``sd`` as the file service discovery's targets, on
    a free port (another, should another process take the one chosen before it binds)."""
    assert PROMETHEUS is not None
    sd_file = workdir / "targets.json"
    sd_file.write_text(json.dumps(sd))
    for job in jobs:
        job["file_sd_configs"] = [{"files": [str(sd_file)], "refresh_interval": "1s"}]
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s",
                                                 "evaluation_interval": "1s"},
                                      "scrape_configs": jobs}))
    log = workdir / "prometheus.log"
    for _ in range(5):
        port = free_port()
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT)
        prom = Prometheus(f"http://127.0.0.1:{port}")
        try:
            if _ready(prom, proc, config, log):
                yield prom
                return
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    raise AssertionError("no free port for prometheus in 5 tries")


def _ready(prom: Prometheus, proc: subprocess.Popen[bytes], config: Path, log: Path) -> bool:
    """Whether ``proc`` came up (False: its port was taken first); asserts on anything else."""
    deadline = time.monotonic() + 60
    while proc.poll() is None:
        try:  # this Prometheus, not another process on the port
            if prom.api("status/flags")["data"]["config.file"] == str(config):
                return True
        except (OSError, ValueError, KeyError, AssertionError):
            pass
        assert time.monotonic() < deadline, "prometheus not ready in 60 s"
        time.sleep(0.2)
    text = log.read_text()
    assert "address already in use" in text, text[-3000:]
    return False
