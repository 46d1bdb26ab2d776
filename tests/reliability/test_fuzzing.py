"""The fuzz tests' two runs (``fuzzing.fuzz``): fixed regression cases, then random ones whose
seed is printed and replays them."""

from __future__ import annotations

import fuzzing
import pytest
from fuzzing import fuzz, random_cases
from hypothesis import strategies as st


def _drawn(monkeypatch: pytest.MonkeyPatch, seed: int) -> tuple[list[int], list[int]]:
    monkeypatch.setattr(fuzzing, "SEED", seed)
    drawn: list[int] = []

    @fuzz(40, st.integers(0, 2**60))
    def one(x: int) -> None:
        drawn.append(x)

    one()
    fixed = 40 * fuzzing.SCALE
    return drawn[:fixed], drawn[fixed:]


def test_fixed_cases_stay_and_the_random_ones_replay_from_the_printed_seed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fixed, randomly = _drawn(monkeypatch, 1234)
    assert len(fixed) == 40 * fuzzing.SCALE and len(randomly) == random_cases(40)
    assert "seed 1234 (CLEAVE_FUZZ_SEED=1234 replays them)" in capsys.readouterr().out
    again_fixed, replayed = _drawn(monkeypatch, 1234)
    assert replayed == randomly  # the printed seed replays the random run
    if not fuzzing.RANDOM:
        assert again_fixed == fixed  # the regression cases are the same every run
    _, other = _drawn(monkeypatch, 4321)
    assert other != randomly  # another seed, other cases: the random run explores
