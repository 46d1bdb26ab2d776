"""The worker's reading of the ``sampling`` object the router sends (the engine's
``SamplingParams`` fields, as ``dataclasses.asdict`` wrote them): strictly typed, so that a wrong
type fails on the request, not on the engine thread later."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cleave.runtime.engine.sequence import RequestError, SamplingParams

_INT_FIELDS = ("max_tokens", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sampling_from_json(data: Any) -> SamplingParams:
    """Strictly typed: a wrong type must fail here, not on the engine thread later."""
    if not isinstance(data, dict):
        raise RequestError("sampling must be an object")
    for k in _INT_FIELDS:
        if k in data and not is_int(data[k]):
            raise RequestError(f"sampling.{k} must be an integer")
    for k in _OPTIONAL_INT_FIELDS:
        if data.get(k) is not None and not is_int(data[k]):
            raise RequestError(f"sampling.{k} must be an integer or null")
    for k in _FLOAT_FIELDS:
        if k in data and (isinstance(data[k], bool) or not isinstance(data[k], int | float)):
            raise RequestError(f"sampling.{k} must be a number")
    checks: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
        ("stop", lambda v: isinstance(v, str), "strings"),
        ("stop_token_ids", is_int, "integers"),
        ("logit_bias", _bias_pair, "[token id, bias] pairs"))
    for k, ok, kind in checks:
        if not list_of(data.get(k, []), ok):
            raise RequestError(f"sampling.{k} must be a list of {kind}")
    if not isinstance(data.get("ignore_eos", False), bool):
        raise RequestError("sampling.ignore_eos must be true or false")
    for k in ("grammar", "cache_salt"):
        if not isinstance(data.get(k), str | None):
            raise RequestError(f"sampling.{k} must be a string or null")
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                              for k, v in data.items()}
    if "logit_bias" in fields:  # asdict() sent the pairs as lists
        fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields["logit_bias"])
    try:
        return SamplingParams(**fields)
    except TypeError as e:
        raise RequestError(f"bad sampling parameters: {e}") from None


def _bias_pair(v: Any) -> bool:
    return (isinstance(v, list) and len(v) == 2 and is_int(v[0])
            and not isinstance(v[1], bool) and isinstance(v[1], int | float))


def list_of(value: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(ok(v) for v in value)
