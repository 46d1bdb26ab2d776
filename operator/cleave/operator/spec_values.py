"""Readers of one spec value each: the type and range checks behind every field of
:mod:`cleave.operator.spec`, failing with :class:`SpecError` and the field's path."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cleave.common.quantity import parse_bytes


class SpecError(ValueError):
    """The spec cannot be honoured; the message goes into the Degraded condition."""


def integer(raw: Mapping[str, Any], key: str, default: int, low: int, where: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpecError(f"{where}.{key} must be an integer >= {low}, got {value!r}")
    return value


def size(raw: Any, where: str) -> int | None:
    if raw is None:
        return None
    try:
        return parse_bytes(raw)
    except ValueError as e:
        raise SpecError(f"{where}: {e}") from None


def boolean(raw: Mapping[str, Any], key: str, where: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):  # bool("false") is True: a quoted YAML value would act
        raise SpecError(f"{where}.{key} must be true or false, got {value!r}")
    return value


def seconds(raw: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SpecError(f"{where}.{key} must be a number > 0, got {value!r}")
    return float(value)


def optional_positive(raw: Mapping[str, Any], key: str, where: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise SpecError(f"{where}.{key} must be a finite number > 0, got {value!r}")
    return float(value)


def no_password_in(url: str, where: str) -> None:
    """The operator writes the Redis URL into every pod's command line, which any user of a
    node can read (ps): a password belongs in passwordSecret, which reaches the pods through
    their environment."""
    parts = urlsplit(url)
    if parts.password is not None or "password" in parse_qs(parts.query):
        raise SpecError(f"{where} holds a password: put it in a Secret and name it in "
                        "spec.kvStore.external.passwordSecret")
