"""Lets the test modules here import their shared helpers (``*_support.py``) with a plain import."""

from __future__ import annotations

import sys
from pathlib import Path

# Appended, not prepended: ``tests/`` stays first, so ``from conftest import ...`` still finds
# ``tests/conftest.py``.
sys.path.append(str(Path(__file__).parent))
