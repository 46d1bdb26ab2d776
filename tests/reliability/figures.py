"""The figures each reliability test measured, printed as one greppable JSON line.

``pytest -s tests/reliability | grep '^reliability '`` collects them.
"""

from __future__ import annotations

import json
from typing import Any


def report(test: str, **figures: Any) -> None:
    print(f"reliability {json.dumps({'test': test, **figures}, sort_keys=False)}", flush=True)
