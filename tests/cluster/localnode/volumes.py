"""Pod volumes as host directories, and each container's bind mounts of them.

emptyDir is a fresh directory (mode 0777) under the pod's dir; configMap and secret volumes
are files written once at pod start (``items``, ``defaultMode``/``mode`` and ``optional``
honoured; not refreshed when the object changes); persistentVolumeClaim is a host directory
from the node's ``claims`` mapping, or, for a PersistentVolumeClaim object the node was not
told about, one it provisions under its workdir (kind's local-path provisioner does the
same); hostPath is the host path itself. The service account token, CA and namespace are a
read-only mount at the usual path. The launcher makes the mounts in the pod's mount namespace.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .env import ConfigError, Get, source_data

Obj = dict[str, Any]
SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


class VolumeError(ConfigError):
    """A volume cannot be set up (yet). ``unschedulable``: the pod cannot run on this node
    at all (an unknown claim), rather than waiting for a Secret or ConfigMap to appear."""

    def __init__(self, message: str, unschedulable: bool = False) -> None:
        super().__init__(message)
        self.unschedulable = unschedulable


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool


def _write_files(root: Path, data: dict[str, bytes], volume: Obj, optional: bool) -> None:
    default_mode = int(volume.get("defaultMode", 0o644))
    items = volume.get("items") or [{"key": k, "path": k} for k in data]
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise VolumeError(f"key {item['key']!r} not found for volume {volume}")
        path = root / posixpath.normpath(item["path"]).lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[item["key"]])
        path.chmod(int(item.get("mode", default_mode)))


def prepare(pod: Obj, pod_dir: Path, get: Get, claims: dict[str, Path],
            provision_dir: Path) -> dict[str, Path]:
    """Set up every volume of the pod; returns volume name -> host directory."""
    namespace = pod["metadata"].get("namespace") or "default"
    out: dict[str, Path] = {}
    for vol in pod["spec"].get("volumes") or []:
        path = pod_dir / "volumes" / vol["name"]
        if "emptyDir" in vol:
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)
        elif "configMap" in vol or "secret" in vol:
            kind = "secret" if "secret" in vol else "configmap"
            src = vol.get("secret") or vol.get("configMap") or {}
            optional = bool(src.get("optional"))
            name = src.get("secretName") if kind == "secret" else src.get("name")
            try:
                data = source_data(get, kind, namespace, str(name), optional) or {}
            except ConfigError as e:
                raise VolumeError(f"volume {vol['name']}: {e}") from e
            path.mkdir(parents=True, exist_ok=True)
            _write_files(path, data, src, optional)
        elif "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            if claim in claims:
                path = Path(claims[claim])
            elif get("persistentvolumeclaims", namespace, claim) is not None:
                path = provision_dir / namespace / claim
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o777)
            else:
                raise VolumeError(f'persistentvolumeclaim "{claim}" not found (neither in the '
                                  "node's claims nor in the API)", unschedulable=True)
        elif "hostPath" in vol:
            path = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type") == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
        else:
            kinds = sorted(set(vol) - {"name"})
            raise VolumeError(f"volume {vol['name']}: {kinds} not supported by the local node")
        out[vol["name"]] = path
    return out


def service_account(pod: Obj, pod_dir: Path, ca: Path, mint: Callable[[str, str], str],
                    ) -> Path:
    """The token dir the API clients' in-cluster config reads: a random token ``mint`` made
    for the pod's ServiceAccount (the API proxy authenticates and authorizes with it)."""
    sa_dir = pod_dir / "serviceaccount"
    sa_dir.mkdir(parents=True, exist_ok=True)
    sa = pod["spec"].get("serviceAccountName") or "default"
    namespace = pod["metadata"].get("namespace") or "default"
    (sa_dir / "token").write_text(mint(namespace, sa))
    (sa_dir / "ca.crt").write_bytes(ca.read_bytes())
    (sa_dir / "namespace").write_text(namespace)
    return sa_dir


def container_mounts(container: Obj, volumes: dict[str, Path], sa_dir: Path | None,
                     ) -> list[Mount]:
    """The container's mounts, parents before children (``subPath`` honoured)."""
    mounts = []
    for m in container.get("volumeMounts") or []:
        if m["name"] not in volumes:
            raise VolumeError(f"volumeMount {m['mountPath']}: no volume {m['name']!r}")
        source = volumes[m["name"]]
        if sub := m.get("subPath"):
            source = source / posixpath.normpath(sub).lstrip("/")
            if not source.exists():
                source.mkdir(parents=True, mode=0o777)
        mounts.append(Mount(source, posixpath.normpath(m["mountPath"]),
                            bool(m.get("readOnly"))))
    if sa_dir is not None and all(m.target != SA_PATH for m in mounts):
        mounts.append(Mount(sa_dir, SA_PATH, True))
    return sorted(mounts, key=lambda m: m.target.count("/"))


class MountPoints:
    """Mount points missing on the host, created for pods and removed when the node stops.

    A bind mount needs an existing target, and the root filesystem is the host's: this is the
    node's one footprint outside its workdir (empty dirs such as /cache, /models,
    /run/secrets/kubernetes.io/serviceaccount), removed on exit if still empty.
    """

    def __init__(self) -> None:
        self.created: list[Path] = []
        self._lock = threading.Lock()

    def ensure(self, mounts: list[Mount], hidden: Path | None) -> None:
        with self._lock:
            for m in mounts:
                target = Path(m.target)
                if (hidden and target.is_relative_to(hidden)) or any(
                        o is not m and target.is_relative_to(o.target) for o in mounts):
                    continue  # the launcher makes it inside a tmpfs or a volume
                missing = [p for p in [*reversed(target.parents), target] if not p.exists()]
                for p in missing:
                    if p == target and not m.source.is_dir():
                        p.touch()
                    else:
                        p.mkdir()
                    self.created.append(p)

    def remove(self) -> None:
        with self._lock:
            for p in reversed(self.created):
                with contextlib.suppress(OSError):
                    if p.is_dir():
                        p.rmdir()  # only if empty
                    elif os.path.getsize(p) == 0:
                        p.unlink()
            self.created.clear()
