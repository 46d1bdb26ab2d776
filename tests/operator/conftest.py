"""Lets the test modules here import their shared helpers (``*_support.py``) with a plain import."""

from __future__ import annotations

import sys
from pathlib import Path

# Appended, not prepended: ``tests/`` stays first on the path. (No test imports a conftest
# by name: several folders have one; shared helpers live in plain modules.)
sys.path.append(str(Path(__file__).parent))
