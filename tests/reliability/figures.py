"""The figures each reliability test measured, printed as one greppable JSON line.

``pytest -s tests/reliability | grep '^reliability '`` collects them.
"""

from __future__ import annotations

import json
from typing import Any


def report(test: str, **figures: Any) -> None:
    # On a line of its own: pytest -s writes the test file's name (or a progress dot) first.
    print(f"\nreliability {json.dumps({'test': test, **figures}, sort_keys=False)}", flush=True)
