"""JSON request fields read strictly, and the OpenAI-shaped error a bad one becomes.

Shared by every request parser of the router (protocol.py, sampling_fields.py, vllm_api.py):
one reading of "an integer", "a number in a range", "null means not given".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

JSONObject = dict[str, Any]
ErrorType = Literal["invalid_request_error", "not_found_error", "authentication_error",
                    "rate_limit_exceeded", "server_error", "service_unavailable"]


class APIError(Exception):
    """A failure to report to the client as OpenAI does: status code plus an ``error`` body."""

    def __init__(self, status: int, message: str, type: ErrorType = "invalid_request_error",
                 *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type: ErrorType = type
        self.param = param
        self.code = code

    def body(self) -> JSONObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


def as_int(v: object) -> int | None:
    """``v`` as an int, or None. Booleans are not ints; 2.0 is, as in JSON Schema's "integer"."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def read_int(body: Mapping[str, object], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:  # JSON null means "not given", as OpenAI treats it
        return None
    i = as_int(v)
    if i is None:
        raise bad(name, f"'{name}' must be an integer")
    if not lo <= i <= hi:
        raise bad(name, f"'{name}' must be in [{lo}, {hi}], got {i}")
    return i


def read_float(body: Mapping[str, object], name: str, lo: float, hi: float,
           *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"'{name}' must be a number")
    # Compared before float(): a huge int would overflow it; NaN (json.loads accepts it) fails.
    if not ((lo < v if lo_open else lo <= v) and v <= hi):
        raise bad(name, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def read_bool(body: Mapping[str, object], name: str, param: str | None = None) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        param = param or name
        raise bad(param, f"'{param}' must be a boolean")
    return v if isinstance(v, bool) else None
