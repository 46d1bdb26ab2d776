"""The reliability suite: load, chaos, fuzzing and security against real processes.

Its helpers are plain modules next to the tests (``up_stack``, ``stream_load``,
``figures``); this puts them on the import path.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Appended, not prepended: ``tests/`` stays first on the path.
sys.path.append(str(Path(__file__).parent))
