"""Lets the test modules here import the local node (``localnode``) and the API emulator's
helpers (``kmock_support`` in tests/operator) with plain imports."""

from __future__ import annotations

import sys
from pathlib import Path

# Appended, not prepended: ``tests/`` stays first on the path (see tests/operator/conftest.py).
HERE = Path(__file__).parent
for path in (HERE, HERE.parent / "operator"):
    if str(path) not in sys.path:
        sys.path.append(str(path))

# The local node's fixtures (a node per test module); modules with their own override them.
from node_support import apps, core, emu, models, node  # noqa: E402, F401

