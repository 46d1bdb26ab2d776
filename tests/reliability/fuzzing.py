"""Hypothesis settings shared by the fuzz tests.

Derandomized, so a given command draws the same cases every run and a failure reproduces
(Hypothesis also mixes in constants from the modules loaded, so one file run alone draws another
fixed set than the whole suite). ``CLEAVE_FUZZ_SCALE=10`` runs ten times the cases;
``CLEAVE_FUZZ_RANDOM=1`` draws new ones.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("CLEAVE_FUZZ_SCALE", "1")))
RANDOM = os.environ.get("CLEAVE_FUZZ_RANDOM") == "1"


def fuzz_settings(max_examples: int) -> settings:
    """``max_examples`` (times the scale), no deadline, nothing stored between runs."""
    return settings(max_examples=max_examples * SCALE, deadline=None, derandomize=not RANDOM,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])
