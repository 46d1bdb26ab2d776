"""Container launcher: run by the node as ``ip netns exec <netns> python launcher.py SPEC``.

``ip netns exec`` has already put this process in the pod's network namespace and in a new
mount namespace (with the pod's hosts file over /etc/hosts). Here, as root, the launcher does
what the container runtime would: its own UTS namespace with the pod's hostname, the volume
bind mounts, a read-only root filesystem, the pod user; then it execs the container's command
(same pid, so the node's signals reach it). The spec is a JSON file only root can read: it
holds the environment, with secrets. A standalone script, so that it imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
CLONE_NEWUTS, PR_SET_NO_NEW_PRIVS = 0x04000000, 38
libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(),
                      ctypes.c_ulong(flags), data.encode()), f"mount {src} on {dst}")


def bind(src: str, dst: str, readonly: bool) -> None:
    mount(src, dst, None, MS_BIND | MS_REC)
    if readonly:
        mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def reveal(hide: str, keep: list[str]) -> None:
    """Hide ``hide`` (e.g. /root, mode 0700) under a tmpfs but bind ``keep`` (the Python
    installation the venv runs on) back in: a non-root pod user can then run the venv's
    interpreter, as it could the /usr/local/bin/python of an image."""
    fds = [(os.open(path, os.O_PATH), path) for path in keep]  # reachable once hidden
    mount("tmpfs", hide, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    for fd, path in fds:
        os.makedirs(path, exist_ok=True)
        bind(f"/proc/self/fd/{fd}", path, readonly=True)
        os.close(fd)


def main(spec_path: str) -> None:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    _check(libc.unshare(CLONE_NEWUTS), "unshare(CLONE_NEWUTS)")
    socket.sethostname(spec["hostname"])
    if spec.get("reveal"):
        reveal(*spec["reveal"])
    # Open every source first: a volume mounted at, say, /var/tmp must not hide the sources
    # of the mounts after it (they live in the node's workdir), nor the image's paths.
    image = [(os.open(path, os.O_PATH), path) for path in spec.get("image") or []]
    sources = [(os.open(m["source"], os.O_PATH), m) for m in spec["mounts"]]
    for fd, m in sources:
        if not os.path.exists(m["target"]):  # inside a tmpfs above; the node made the rest
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(m["target"])
            else:
                Path(m["target"]).touch()
        bind(f"/proc/self/fd/{fd}", m["target"], m["readOnly"])
        os.close(fd)
    targets = [m["target"].rstrip("/") + "/" for m in spec["mounts"]]
    for fd, path in image:  # a volume over the image's files: bind them back, as they were
        if any((path + "/").startswith(t) for t in targets):
            os.makedirs(path, exist_ok=True)
            bind(f"/proc/self/fd/{fd}", path, readonly=True)
        os.close(fd)
    if spec["readOnlyRoot"]:
        mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    os.chdir(spec["workingDir"])
    if spec["noNewPrivs"]:
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if spec["uid"] != 0 or spec["gid"] != 0 or spec["groups"]:
        os.setgroups(spec["groups"])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    argv, env = spec["argv"], spec["env"]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"localnode: cannot run {argv[0]!r}: {e}", file=sys.stderr, flush=True)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1])
