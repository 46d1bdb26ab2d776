"""Attack surface: RBAC verbs the operator is granted but never uses (issue 15). Must be 0.

A grant nothing calls is only power for whoever steals the operator's token. The test is
tests/operator/test_rbac_used.py's (the real operator against the recording API emulator,
through a service's life, compared with the chart's ClusterRole both ways), run here as well
so that the reliability run reports its figure: ``reliability {"test": "rbac_verbs", ...}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "operator"
if str(OPERATOR_TESTS) not in sys.path:
    sys.path.append(str(OPERATOR_TESTS))

# Imported, not copied: pytest collects the test and its fixtures here too.
from test_rbac_used import (  # noqa: E402
    emu,
    servers,
    test_the_operator_uses_exactly_the_verbs_the_chart_grants,
)

__all__ = ["emu", "servers", "test_the_operator_uses_exactly_the_verbs_the_chart_grants"]
