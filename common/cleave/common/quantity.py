"""Byte sizes as Kubernetes quantities: one reading for the CRD, the chart and every CLI.

``256Mi``, ``2Gi``, ``1.5G`` (10^9), ``500M``, ``1e9`` and plain byte counts read as the API
server reads a quantity (apimachinery's grammar, below), so a size means the same in a custom
resource, a pod's resources and a ``cleave`` flag. The older ``2GiB``/``512MiB`` spellings are
read as ``2Gi``/``512Mi``. Written here rather than taken from the kubernetes client: the
runtime image does not carry that client (docs/images.md), and a test checks this parser
against the client's on every quantity the grammar allows.
"""

from __future__ import annotations

import re
from decimal import Decimal

_BINARY = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))
_LEGACY = re.compile(r"^(.*[KMGTPE]i)B$")
# <signedNumber> then a binary suffix, a decimal exponent, or a decimal SI suffix (or none).
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
                       r"(?:([KMGTPE])i|[eE]([+-]?[0-9]+)|([numkMGTPE]?))")
_DECIMAL_EXPONENT = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12,
                     "P": 15, "E": 18}
_MAX = Decimal(2) ** 63 - 1  # Kubernetes quantities are int64


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity -> its exact value (ValueError if the text is not one)."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, binary, exponent, decimal_si = match.groups()
    value = Decimal(number)
    if binary is not None:
        return value * (1 << (10 * ("KMGTPE".index(binary) + 1)))
    shift = int(exponent) if exponent is not None else _DECIMAL_EXPONENT[decimal_si]
    if value and abs(shift) > 100:  # no byte count is that far from 1: refuse, don't compute
        raise ValueError(f"{text!r} is out of range")
    return value.scaleb(shift)


def parse_bytes(text: str | int) -> int:
    """A quantity of bytes -> a positive whole number of bytes (ValueError if not one)."""
    raw = str(text).strip()
    legacy = _LEGACY.match(raw)
    try:
        exact = parse_quantity(legacy.group(1) if legacy else raw)
    except ValueError:
        raise ValueError(f"{text!r} is not a byte quantity (e.g. 512Mi, 2Gi, 1G, "
                         "1000000)") from None
    if exact != exact.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of bytes")
    if exact <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    if exact > _MAX:
        raise ValueError(f"{text!r} is too large")
    return int(exact)


def format_bytes(value: int) -> str:
    """Bytes -> the shortest exact binary quantity (``268435456`` -> ``256Mi``)."""
    for suffix, scale in _BINARY:
        if value % scale == 0:
            return f"{value // scale}{suffix}"
    return str(value)
