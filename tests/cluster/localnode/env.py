"""A container's environment and command line, resolved as the kubelet does.

The "image" contributes PATH (the project's venv first: its ``cleave``, ``python`` and
friends stand in for what an image would ship), HOME=/ and the node's ``image_env`` (what an
image's ENV lines would set, e.g. where it baked a converted model). Then come the service variables
the kubelet always sets for the API (KUBERNETES_SERVICE_HOST/PORT), ``envFrom``, and ``env``
in order, where ``$(VAR)`` refers to what is defined before it; ``command`` and ``args`` are
expanded last. A missing Secret, ConfigMap or key that is not ``optional`` raises
:class:`ConfigError`: the container then waits in CreateContainerConfigError and is retried.
"""

from __future__ import annotations

import base64
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Obj = dict[str, Any]
Get = Callable[[str, str, str], Obj | None]  # (resource, namespace, name) -> object or None

VENV_BIN = str(Path(sys.executable).parent)
PATH = f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin"
VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class ConfigError(Exception):
    """What keeps a container from being created (the message goes into its status)."""


def expand(text: str, env: dict[str, str]) -> str:
    """``$(VAR)`` becomes its value if defined (else stays as written); ``$$`` becomes ``$``."""
    return VAR_REF.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def secret_data(secret: Obj) -> dict[str, bytes]:
    """A Secret's values: ``data`` is base64; the emulator also keeps ``stringData`` as sent
    (an API server would have merged it into ``data``; it wins, as it would there)."""
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    return data | {k: str(v).encode() for k, v in (secret.get("stringData") or {}).items()}


def configmap_data(cm: Obj) -> dict[str, bytes]:
    data = {k: str(v).encode() for k, v in (cm.get("data") or {}).items()}
    return data | {k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()}


def source_data(get: Get, kind: str, namespace: str, name: str, optional: bool,
                ) -> dict[str, bytes] | None:
    """The data of a Secret or ConfigMap; None if it is missing and optional."""
    obj = get("secrets" if kind == "secret" else "configmaps", namespace, name)
    if obj is None:
        if optional:
            return None
        raise ConfigError(f'{kind} "{name}" not found')
    return secret_data(obj) if kind == "secret" else configmap_data(obj)


def _key_ref(get: Get, kind: str, namespace: str, ref: Obj) -> str | None:
    optional = bool(ref.get("optional"))
    data = source_data(get, kind, namespace, ref["name"], optional)
    if data is None or ref["key"] not in data:
        if optional:
            return None
        raise ConfigError(f"couldn't find key {ref['key']} in {kind} {namespace}/{ref['name']}")
    return data[ref["key"]].decode()


def field(pod: Obj, path: str, pod_ip: str, host_ip: str) -> str:
    """The downward API's ``fieldRef`` paths."""
    meta, spec = pod["metadata"], pod["spec"]
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return str((meta.get(m[1]) or {}).get(m[2], ""))
    values = {"metadata.name": meta["name"], "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "status.podIP": pod_ip, "status.podIPs": pod_ip,
              "status.hostIP": host_ip, "status.hostIPs": host_ip,
              "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName") or "default"}
    if path not in values:
        raise ConfigError(f"unsupported fieldRef {path!r}")
    return str(values[path] or "")


def container_env(pod: Obj, container: Obj, get: Get, pod_ip: str, host_ip: str,
                  api: tuple[str, int], image_env: dict[str, str] | None = None,
                  ) -> dict[str, str]:
    namespace = pod["metadata"].get("namespace") or "default"
    env = {"PATH": PATH, "HOME": "/", **(image_env or {}),
           "HOSTNAME": pod["spec"].get("hostname")
           or pod["metadata"]["name"], "KUBERNETES_SERVICE_HOST": api[0],
           "KUBERNETES_SERVICE_PORT": str(api[1]), "KUBERNETES_SERVICE_PORT_HTTPS": str(api[1]),
           "KUBERNETES_PORT": f"tcp://{api[0]}:{api[1]}"}
    for source in container.get("envFrom") or []:
        kind = "secret" if "secretRef" in source else "configmap"
        ref = source.get("secretRef") or source.get("configMapRef") or {}
        data = source_data(get, kind, namespace, ref["name"], bool(ref.get("optional"))) or {}
        for key, raw in data.items():
            name = source.get("prefix", "") + key
            if ENV_NAME.match(name):  # the kubelet skips keys that are not valid names
                env[name] = raw.decode()
    for var in container.get("env") or []:
        value: str | None
        if "valueFrom" not in var:
            value = expand(str(var.get("value", "")), env)
        elif (ref := var["valueFrom"].get("secretKeyRef")) is not None:
            value = _key_ref(get, "secret", namespace, ref)
        elif (ref := var["valueFrom"].get("configMapKeyRef")) is not None:
            value = _key_ref(get, "configmap", namespace, ref)
        elif (ref := var["valueFrom"].get("fieldRef")) is not None:
            value = field(pod, ref["fieldPath"], pod_ip, host_ip)
        else:
            raise ConfigError(f"env {var['name']}: unsupported valueFrom {var['valueFrom']}")
        if value is not None:
            env[var["name"]] = value
    return env


def command_line(container: Obj, env: dict[str, str]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expanded; there is no image to default them."""
    if not container.get("command"):
        raise ConfigError("no command: the local node runs no images, so a container must "
                          "say what to run")
    return [expand(str(a), env) for a in [*container["command"], *(container.get("args") or [])]]
