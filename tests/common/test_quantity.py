"""The hand-written Kubernetes quantity parser reads every quantity as the kubernetes client does
(the runtime image has no kubernetes client, so ``cleave.common.quantity`` cannot use it)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.utils.quantity import parse_quantity as client_parse_quantity

from cleave.common.quantity import parse_bytes, parse_quantity

_DIGITS = st.text("0123456789", min_size=1, max_size=9)
_NUMBER = st.one_of(
    _DIGITS,
    st.builds(lambda a, b: f"{a}.{b}", _DIGITS, _DIGITS),
    st.builds(lambda a: f"{a}.", _DIGITS),
    st.builds(lambda b: f".{b}", _DIGITS),
)
_SUFFIX = st.one_of(
    st.sampled_from(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]),
    st.sampled_from(["n", "u", "m", "", "k", "M", "G", "T", "P", "E"]),
    st.builds(lambda e, sign, n: f"{e}{sign}{n}", st.sampled_from("eE"),
              st.sampled_from(["", "+", "-"]), st.integers(0, 30)),
)
QUANTITY = st.builds(lambda sign, number, suffix: f"{sign}{number}{suffix}",
                     st.sampled_from(["", "+", "-"]), _NUMBER, _SUFFIX)


@given(QUANTITY)
def test_every_quantity_of_the_grammar_reads_as_the_kubernetes_client_reads_it(text: str
                                                                               ) -> None:
    assert parse_quantity(text) == client_parse_quantity(text)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize(("text", "value"), [
    ("1E", Decimal(10) ** 18), ("1E3", Decimal(1000)), ("1e-3", Decimal("0.001")),
    ("100m", Decimal("0.1")), ("1.5Gi", Decimal(3 << 29)), ("+.5k", Decimal(500)),
])
def test_suffixes_and_exponents(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("bad", ["", "1 Gi", "1ki", "1K", "1e3k", "Gi", "1.2.3", "NaN",
                                 "Infinity", "1_000", "0x10", "1e"])
def test_what_the_api_server_refuses_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(bad)


def test_byte_sizes_beyond_int64_or_absurd_exponents_are_refused_without_computing() -> None:
    for bad in ("9Ei", "1e999999999", "1e-999999999"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    assert parse_bytes("7Ei") == 7 << 60
