"""Fuzzing the HTTP API: generated request bodies against a real ``cleave up``.

Bodies are bytes that are not JSON, arbitrary JSON values, and near-valid completion and
chat requests whose every field may hold any JSON value (NaN, huge integers, nested lists,
unknown keys). Whatever the body: no 5xx, an error is an OpenAI-shaped JSON object, a 200 is a
whole response (a stream ends with ``data: [DONE]`` and carries no error event), every reply
matches the OpenAPI document's response schema and the ``openai`` client's types
(tests/runtime/response_support.py), no process logs an unhandled exception, and the next valid
request is served.
"""

from __future__ import annotations

import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from figures import report
from fuzzing import SCALE, fuzz
from hypothesis import strategies as st
from up_stack import UpProcess, running_up

sys.path.append(str(Path(__file__).parents[1] / "runtime"))

from response_support import CHECKED, check_reply

MAX_MODEL_LEN = 96  # bounds how long any generated request can run
# Stands for the served model (a temp path) in generated bodies, so the cases do not depend on
# the path: derandomized runs then draw exactly the same ones.
MODEL = "<served-model>"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10)
small_ints = st.integers(-3, MAX_MODEL_LEN + 8)
any_of = st.one_of  # readability: "this field holds a plausible value or anything at all"

# Per field: values a client could plausibly send (many valid), and anything at all.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": small_ints,
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 600),
    "seed": st.integers(-(2**65), 2**65),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=6),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "n": st.integers(0, 3),
    "presence_penalty": st.sampled_from([0, 0.0, 0.5]),
    "logit_bias": st.dictionaries(st.text(max_size=4), st.integers(-100, 100), max_size=1),
    "user": st.text(max_size=10),
}
CHAT_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "max_completion_tokens": small_ints,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 25),
    "tools": st.just([]) | st.none(),
    "response_format": st.just({"type": "text"}),
}
COMPLETION_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "logprobs": st.integers(-1, 25) | st.none(),
    "echo": st.booleans(),
    "suffix": st.none() | st.text(max_size=3),
    "best_of": st.integers(0, 2),
}


def near_valid(chat: bool, wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    """A request whose fields hold plausible values, or (``wild``) any JSON value at all."""
    def field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return any_of(plausible, json_values) if wild else plausible

    fields = {**PLAUSIBLE, **(CHAT_PLAUSIBLE if chat else COMPLETION_PLAUSIBLE)}
    optional = {name: field(strategy) for name, strategy in fields.items()}
    if wild:
        optional["unknown_field"] = json_values
    if chat:
        message = st.fixed_dictionaries(
            {"role": field(st.sampled_from(["user", "system", "assistant", "tool"])),
             "content": field(st.text(max_size=60) | st.lists(st.fixed_dictionaries(
                 {"type": st.sampled_from(["text", "image_url"]),
                  "text": st.text(max_size=20)}), max_size=2))},
            optional={"name": field(st.text(max_size=8))})
        required = {"messages": field(st.lists(message, min_size=1, max_size=3))}
    else:
        required = {"prompt": field(st.text(max_size=120)
                                    | st.lists(st.integers(-3, 700), max_size=40))}
    return st.fixed_dictionaries({"model": field(st.just(MODEL)), **required},
                                 optional=optional)


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, bytes]:
    """(endpoint, body); the body names the model :data:`MODEL`."""
    kind = draw(st.sampled_from(["bytes", "json", "wild", "plausible"]))
    chat = draw(st.booleans())
    path = "/chat/completions" if chat else "/completions"
    if kind == "bytes":
        return path, draw(st.binary(max_size=200))
    value = draw(json_values if kind == "json" else near_valid(chat, kind == "wild"))
    return path, json.dumps(value).encode()  # NaN and Infinity go out as Python writes them


def post(url: str, body: bytes) -> tuple[int, str, str]:
    """POST ``body``: the reply's status, content type and text, the reply held to the response
    schemas (a 5xx is left to :func:`check_answer`, which says more of it)."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, content_type, raw = r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        status, content_type, raw = e.code, e.headers.get("Content-Type", ""), e.read()
    if status < 500:
        check_reply("POST", urllib.parse.urlsplit(url).path, status, content_type, raw)
    return status, content_type, raw.decode()


def choices_asked(body: bytes) -> int:
    """The ``n`` a served body asked for (it was accepted, so it is an int if present)."""
    value = json.loads(body)
    n = value.get("n") if isinstance(value, dict) else None
    return n if isinstance(n, int) else 1


def check_answer(status: int, content_type: str, text: str, choices: int) -> None:
    assert status < 500, f"{status}: {text[:300]}"
    if status != 200:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        return
    if content_type.startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event  # no in-band failure
        return
    whole = json.loads(text)
    assert len(whole["choices"]) == choices and whole["usage"]["completion_tokens"] >= 1


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    with running_up(tiny_model_dir, tmp_path_factory.mktemp("fuzz-http"), prefill=1, decode=1,
                    extra_args=["--max-model-len", str(MAX_MODEL_LEN)]) as stack:
        yield stack


def test_generated_bodies_never_break_the_api(up: UpProcess) -> None:
    statuses: dict[int, int] = {}
    checked_before = CHECKED.copy()
    valid = json.dumps({"model": up.model, "prompt": "hello there", "max_tokens": 2}).encode()

    @fuzz(1000, cases())
    def one(case: tuple[str, bytes]) -> None:
        path, body = case
        body = body.replace(json.dumps(MODEL).encode(), json.dumps(up.model).encode())
        status, content_type, text = post(up.base_url + path, body)
        statuses[status] = statuses.get(status, 0) + 1
        check_answer(status, content_type, text, choices_asked(body) if status == 200 else 1)
        status, _, text = post(up.base_url + "/completions", valid)  # still serving
        assert status == 200, text

    one()
    log = up.log_text()
    report("fuzz_http", cases=sum(statuses.values()), statuses=dict(sorted(statuses.items())))
    assert up.proc.poll() is None and "restarting it" not in log, "a process died"
    assert "Error handling request" not in log and "Traceback" not in log, log[-3000:]
    assert sum(statuses.values()) >= 900 * SCALE
    assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 100  # both sides exercised
    # Each case's reply and the valid request's after it were held to the response schemas.
    assert (CHECKED - checked_before).total() == 2 * sum(statuses.values())


def test_float_edge_values_are_refused_by_name(up: UpProcess) -> None:
    """NaN and Infinity are not JSON, but Python clients send them: a 400 naming the field."""
    for field in ("temperature", "top_p"):
        for value in (math.nan, math.inf, -math.inf):
            body = json.dumps({"model": up.model, "prompt": "hi", field: value}).encode()
            status, _, text = post(up.base_url + "/completions", body)
            assert status == 400 and json.loads(text)["error"]["param"] == field, text


def test_a_vanishing_temperature_or_top_p_is_served_as_greedy(up: UpProcess) -> None:
    """Found by the fuzzer: temperature=1e-300, or top_p=5e-324 (0 in fp32), made the
    sampler's softmax NaN, which stopped the decode worker's engine for every later request."""
    def text(**sampling: float) -> str:
        body = json.dumps({"model": up.model, "prompt": "the cat walks", "max_tokens": 6,
                           "ignore_eos": True, **sampling}).encode()
        status, _, answer = post(up.base_url + "/completions", body)
        assert status == 200, answer
        return str(json.loads(answer)["choices"][0]["text"])

    greedy = text(temperature=0.0)
    for tiny in (5e-324, 1e-300, 1e-46, 1e-6):
        assert text(temperature=tiny) == greedy
        assert text(temperature=1.0, top_p=tiny) == greedy
