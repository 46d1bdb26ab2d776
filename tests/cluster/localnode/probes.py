"""Container probes as the kubelet runs them: httpGet, tcpSocket and exec, with their timing.

httpGet and tcpSocket go from the root namespace to the pod IP over the bridge, as the
kubelet's do from the node; exec runs inside the container's namespaces (``nsenter``), as
root, with the container's environment. grpc probes are not supported (they always fail).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Probe:
    """One probe of a container with its consecutive results; :meth:`due` says when to run."""

    spec: dict[str, Any]
    ports: dict[str, int]  # the container's named ports
    started: float  # the container's start (monotonic), for initialDelaySeconds
    successes: int = 0
    failures: int = 0
    last_run: float | None = None

    def _get(self, field: str, default: int) -> int:
        return int(self.spec.get(field) or default)

    @property
    def success_threshold(self) -> int:
        return self._get("successThreshold", 1)

    @property
    def failure_threshold(self) -> int:
        return self._get("failureThreshold", 3)

    def due(self, now: float) -> bool:
        if self.last_run is None:
            return now >= self.started + self._get("initialDelaySeconds", 0)
        return now >= self.last_run + self._get("periodSeconds", 10)

    def run(self, pod_ip: str, pid: int | None, env: dict[str, str]) -> bool:
        """Run it once and count the result; True if it succeeded."""
        self.last_run = time.monotonic()
        ok = check(self.spec, self.ports, pod_ip, pid, env, self._get("timeoutSeconds", 1))
        self.successes, self.failures = (self.successes + 1, 0) if ok else (0, self.failures + 1)
        return ok


def _port(value: Any, ports: dict[str, int]) -> int:
    return ports[value] if isinstance(value, str) and not value.isdigit() else int(value)


def check(spec: dict[str, Any], ports: dict[str, int], pod_ip: str, pid: int | None,
          env: dict[str, str], timeout: float) -> bool:
    try:
        if (get := spec.get("httpGet")) is not None:
            return _http(get, ports, pod_ip, timeout)
        if (tcp := spec.get("tcpSocket")) is not None:
            host = tcp.get("host") or pod_ip
            with socket.create_connection((host, _port(tcp["port"], ports)), timeout):
                return True
        if (exe := spec.get("exec")) is not None and pid is not None:
            return subprocess.run(
                ["nsenter", "-t", str(pid), "-m", "-n", "-u", "--", *exe["command"]], env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                timeout=timeout).returncode == 0
    except (OSError, KeyError, ValueError, subprocess.TimeoutExpired, http.client.HTTPException):
        return False
    return False


def _http(get: dict[str, Any], ports: dict[str, int], pod_ip: str, timeout: float) -> bool:
    host, port = get.get("host") or pod_ip, _port(get["port"], ports)
    conn: http.client.HTTPConnection
    if str(get.get("scheme", "HTTP")).upper() == "HTTPS":  # like the kubelet: no verification
        conn = http.client.HTTPSConnection(host, port, timeout=timeout,
                                           context=ssl._create_unverified_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
    headers.setdefault("User-Agent", "kube-probe/localnode")
    try:
        conn.request("GET", get.get("path") or "/", headers=headers)
        return 200 <= conn.getresponse().status < 400
    finally:
        with contextlib.suppress(OSError):
            conn.close()
