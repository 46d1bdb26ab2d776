"""The router's port in ``cleave up``'s log: tests start it with ``--port 0`` (it binds a free
port itself, before anything else starts) and read the port from its "Cleave is up" line, so no
other process can take a port chosen for it in advance."""

from __future__ import annotations

import re

_UP = re.compile(r"^Cleave is up: http://[^/\s]+:(\d+)/v1", re.MULTILINE)


def up_port(log: str) -> int | None:
    """The port ``cleave up`` said it serves on; None until it is up."""
    found = _UP.search(log)
    return None if found is None else int(found[1])
