"""The sampling fields beyond temperature and top-p: penalties, logit bias, min-p,
min_tokens, stop token ids and structured outputs, read from a request body (OpenAI's and
vLLM's meanings)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from cleave.runtime.engine.sequence import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOKEN_ID_LIST,
    SamplingParams,
)
from cleave.runtime.serving import structured_fields
from cleave.runtime.serving.json_fields import as_int, bad, read_float, read_int

MAX_TOKENS_LIMIT = 1 << 20  # far beyond any context: rejects absurd values before the engine


class LogitRules(NamedTuple):
    """The request's rules on logits, named as SamplingParams' fields (one meaning each)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    grammar: str | None = None  # structured outputs (structured_fields.py)


def _token_ids(body: Mapping[str, object], name: str) -> tuple[int, ...]:
    v = body.get(name)
    if v is None:
        return ()
    ids = [as_int(t) for t in v] if isinstance(v, list) else [None]
    if not (len(ids) <= MAX_TOKEN_ID_LIST and all(i is not None and i >= 0 for i in ids)):
        raise bad(name, f"'{name}' must be a list of at most {MAX_TOKEN_ID_LIST} token ids "
                         "(integers >= 0)")
    return tuple(i for i in ids if i is not None)


def _logit_bias(v: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}``: JSON keys are strings, the ids in them integers."""
    if v is None:
        return ()
    if not (isinstance(v, dict) and len(v) <= MAX_TOKEN_ID_LIST):
        raise bad("logit_bias", f"'logit_bias' must be an object of at most "
                   f"{MAX_TOKEN_ID_LIST} token ids")
    pairs = []
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad("logit_bias", f"'logit_bias' keys must be token ids, got {key!r}")
        pairs.append((int(key), read_float({"logit_bias": bias}, "logit_bias", -MAX_LOGIT_BIAS,
                                       MAX_LOGIT_BIAS)))
    return tuple((t, b) for t, b in pairs if b is not None)


def logit_rules(body: Mapping[str, object]) -> LogitRules:
    def number(name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
        v = read_float(body, name, lo, hi, lo_open=lo_open)
        return default if v is None else v

    return LogitRules(
        presence_penalty=number("presence_penalty", -MAX_PENALTY, MAX_PENALTY, 0.0),
        frequency_penalty=number("frequency_penalty", -MAX_PENALTY, MAX_PENALTY, 0.0),
        repetition_penalty=number("repetition_penalty", 0.0, MAX_REPETITION_PENALTY, 1.0,
                                  lo_open=True),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_p=number("min_p", 0.0, 1.0, 0.0),
        min_tokens=read_int(body, "min_tokens", 0, MAX_TOKENS_LIMIT) or 0,
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        grammar=structured_fields.grammar(body))


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids the parameters name must be the model's (the engine would refuse them too,
    but without naming the field)."""
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                      ("stop_token_ids", params.stop_token_ids)):
        if any(t >= vocab_size for t in ids):
            raise bad(name, f"'{name}' token ids must be in [0, {vocab_size})")
