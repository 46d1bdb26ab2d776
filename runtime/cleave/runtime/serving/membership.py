"""The workers file: how ``cleave up --autoscale`` tells its router which workers exist.

A JSON object ``{"prefill": [URL, ...], "decode": [URL, ...]}`` ("decode" also holds both-role
workers). ``cleave up`` rewrites it atomically (a temporary file renamed over it) whenever a
worker turns ready or starts draining; the router re-reads it on every health poll. A file is
the simplest robust channel here: no port, no credentials, no ordering between two processes
that start and stop independently, and a reader never sees half a write.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

ROLES = ("prefill", "decode")


def parse_members(text: str) -> dict[str, tuple[str, ...]]:
    """The URLs per role; ValueError naming what is wrong. A missing role means none."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError('expected an object like {"prefill": [...], "decode": [...]}')
    unknown = set(data) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}; expected {list(ROLES)}")
    members: dict[str, tuple[str, ...]] = {}
    for role in ROLES:
        urls = data.get(role, [])
        if not isinstance(urls, list) or not all(
                isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"{role}: expected a list of http(s):// URLs")
        members[role] = tuple(u.rstrip("/") for u in urls)
    return members


def write_atomically(path: Path, text: str) -> None:
    """Replace the file in one step (written aside, then renamed): a reader sees the old
    contents or the new, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_members(path: Path, members: Mapping[str, Sequence[str]]) -> None:
    """Replace the file in one step, so the router reads either the old list or the new one."""
    write_atomically(path, json.dumps({role: list(members.get(role, ())) for role in ROLES}))
