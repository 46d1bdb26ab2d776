"""Hypothesis settings shared by the fuzz tests: fixed regression cases, then a random run.

Each fuzz test runs twice. First derandomized, so a given command draws the same cases every
run and a failure reproduces (Hypothesis also mixes in constants from the modules loaded, so one
file run alone draws another fixed set than the whole suite). Then a bounded random run, a tenth
as many cases, from a seed drawn per session and printed: a failure there names its seed, and
``CLEAVE_FUZZ_SEED=<seed>`` replays that run. ``CLEAVE_FUZZ_SCALE=10`` runs ten times the cases;
``CLEAVE_FUZZ_RANDOM=1`` draws new ones for the fixed part too.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, seed, settings
from hypothesis.strategies import SearchStrategy

SCALE = max(1, int(os.environ.get("CLEAVE_FUZZ_SCALE", "1")))
RANDOM = os.environ.get("CLEAVE_FUZZ_RANDOM") == "1"
_REPLAY = os.environ.get("CLEAVE_FUZZ_SEED")
SEED = int(_REPLAY) if _REPLAY else secrets.randbits(32)  # one per session: one to replay
RANDOM_SHARE = 10  # the random run draws 1/10 of the fixed run's cases: CI time stays bounded


def random_cases(max_examples: int) -> int:
    """How many cases the random run of a ``max_examples`` fuzz test draws."""
    return max(1, max_examples * SCALE // RANDOM_SHARE)


def _settings(max_examples: int, derandomize: bool) -> settings:
    return settings(max_examples=max_examples, deadline=None, derandomize=derandomize,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def fuzz(max_examples: int, *strategies: SearchStrategy[Any]
         ) -> Callable[[Callable[..., None]], Callable[[], None]]:
    """``@given(*strategies)`` for ``max_examples`` fixed cases (times the scale), then
    :func:`random_cases` more from :data:`SEED`; no deadline, nothing stored between runs."""
    def runs(test: Callable[..., None]) -> Callable[[], None]:
        fixed = _settings(max_examples * SCALE, not RANDOM)(given(*strategies)(test))
        drawn = seed(SEED)(_settings(random_cases(max_examples), False)(
            given(*strategies)(test)))

        def both() -> None:
            fixed()
            # Shown with a failure (pytest prints a failing test's output), and with -s.
            print(f"fuzz {test.__qualname__}: {random_cases(max_examples)} random cases, "
                  f"seed {SEED} (CLEAVE_FUZZ_SEED={SEED} replays them)", flush=True)
            drawn()
        return both
    return runs
