"""The platform end to end: real worker processes, a real redis-server, the router over real
HTTP, and the official ``openai`` client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from response_support import checked_client, checked_post
from serving_stack import Stack, post_raw, start_stack

from cleave.common import metric_names as names
from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sequence import SamplingParams

LONG = "the quick brown fox jumps over the lazy dog " * 8  # > 16 tokens: disaggregated
SHORT = "hello there"  # < 16 tokens: served decode-only
TRANSFERRED = names.total(names.KV_TRANSFER_BYTES)
DECISIONS = names.total(names.ROUTING_DECISIONS)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("stack-logs"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                  kv_cache_bytes=1 << 23), progress=lambda _: None)


def _client(stack: Stack, checked: bool = True) -> openai.OpenAI:
    """``checked``: every response held to the schema (read whole as it arrives)."""
    if checked:
        return checked_client(stack.base_url)
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("prompt", [LONG, SHORT])
def test_completion_matches_the_single_engine(stack: Stack, reference: LLMEngine,
                                              prompt: str) -> None:
    got = _client(stack).completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                            temperature=0)
    [want] = reference.generate([prompt], SamplingParams(max_tokens=12))
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == ("length" if len(want.token_ids) == 12 else "stop")
    assert got.usage is not None
    assert got.usage.prompt_tokens == len(reference.tokenize(prompt))
    assert got.usage.completion_tokens == len(want.token_ids)


def test_streaming_completion_equals_the_whole_one(stack: Stack) -> None:
    client = _client(stack)
    whole = client.completions.create(model="tiny", prompt=LONG, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=LONG, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # really streamed
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_chat_streaming_and_not(stack: Stack, reference: LLMEngine) -> None:
    client = _client(stack)
    messages = [{"role": "user", "content": LONG}]
    whole = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=8, temperature=0)
    ids = reference.apply_chat_template(messages)
    [want] = reference.generate([ids], SamplingParams(max_tokens=8))
    assert whole.choices[0].message.content == want.text
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    streamed = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                              max_tokens=8, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(parts) == want.text


def test_models_and_probes(stack: Stack) -> None:
    assert [m.id for m in _client(stack).models.list()] == ["tiny"]
    import urllib.request

    assert urllib.request.urlopen(stack.router.url + "/health").status == 200  # type: ignore[union-attr]
    doc = json.loads(urllib.request.urlopen(stack.router.url + "/openapi.json").read())  # type: ignore[union-attr]
    assert "/v1/chat/completions" in doc["paths"]
    metrics = urllib.request.urlopen(stack.router.url + "/metrics").read().decode()  # type: ignore[union-attr]
    assert names.total(names.ROUTING_DECISIONS) in metrics


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b'{"model": "nope", "prompt": "x"}', 404, "model"),
    (b'{"model": "tiny", "prompt": 5}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "' + b"word " * 600 + b'"}', 400, "max_tokens"),
])
def test_bad_requests_get_openai_shaped_errors(stack: Stack, body: bytes, status: int,
                                               param: str | None) -> None:
    code, reply = checked_post(stack.base_url + "/completions", body)
    assert code == status
    error = reply["error"]
    assert isinstance(error, dict) and error["message"] and error["type"]
    if param:
        assert error["param"] == param
    ok = _client(stack).completions.create(model="tiny", prompt="still fine", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_ids_carry_vllms_and_openais_prefixes(stack: Stack) -> None:
    client = _client(stack)
    raw = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=2)
    assert raw.parse().id == "cmpl-" + raw.headers["x-request-id"]  # the id the logs show
    chat = client.chat.completions.create(model="tiny", max_tokens=2, stream=True,
                                          messages=[{"role": "user", "content": "x"}])
    ids = {c.id for c in chat}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")


def test_requests_get_an_id_header(stack: Stack) -> None:
    raw = _client(stack).completions.with_raw_response.create(model="tiny", prompt="x",
                                                             max_tokens=2)
    assert raw.headers.get("x-request-id")
    assert raw.parse().choices


def _metric(url: str, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics").read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_long_prompts_are_disaggregated_and_short_ones_are_not(stack: Stack) -> None:
    assert stack.router is not None
    name = names.total(names.ROUTING_DECISIONS)
    before_long = _metric(stack.router.url, name + '{path="disaggregated",reason="long_prompt"}')
    before_short = _metric(stack.router.url, name + '{path="decode_only",reason="short_prompt"}')
    client = _client(stack)
    client.completions.create(model="tiny", prompt=f"{time.time_ns()} " + LONG, max_tokens=2)
    client.completions.create(model="tiny", prompt=SHORT, max_tokens=2)
    assert _metric(stack.router.url,
                   name + '{path="disaggregated",reason="long_prompt"}') == before_long + 1
    assert _metric(stack.router.url,
                   name + '{path="decode_only",reason="short_prompt"}') == before_short + 1
    prefill = next(w for w in stack.workers if w.name.startswith("prefill"))
    assert _metric(prefill.url, names.total(names.STORE_WRITTEN_BYTES)) > 0


@pytest.fixture
def own_stack(tiny_model_dir: Path, tmp_path: Path,
              request: pytest.FixtureRequest) -> Iterator[Stack]:
    """A stack of its own; ``indirect`` parametrization gives its number of prefill workers."""
    s = start_stack(tiny_model_dir, tmp_path, prefill=getattr(request, "param", 1))
    yield s
    s.stop()


def test_dead_redis_means_recompute_not_failure(own_stack: Stack, reference: LLMEngine) -> None:
    own_stack.redis.kill()
    decode = next(w for w in own_stack.workers if w.name.startswith("decode"))
    started = time.monotonic()
    got = _client(own_stack).completions.create(model="tiny", prompt=LONG, max_tokens=8,
                                                temperature=0)
    assert time.monotonic() - started < 10
    [want] = reference.generate([LONG], SamplingParams(max_tokens=8))
    assert got.choices[0].text == want.text
    assert _metric(decode.url, names.total(names.KV_RECOMPUTE_FALLBACKS)) >= 1


def test_only_prefill_worker_down_is_served_decode_only(own_stack: Stack,
                                                        reference: LLMEngine) -> None:
    prefill = next(w for w in own_stack.workers if w.name.startswith("prefill"))
    prefill.kill()
    got = _client(own_stack).completions.create(model="tiny", prompt=LONG, max_tokens=8,
                                                temperature=0)
    [want] = reference.generate([LONG], SamplingParams(max_tokens=8))
    assert got.choices[0].text == want.text


# No prefill worker: nobody can take the stream over (with one, it resumes there:
# tests/runtime/test_convertible.py).
@pytest.mark.parametrize("own_stack", [0], indirect=True)
def test_decode_worker_killed_mid_stream_ends_clearly(own_stack: Stack,
                                                      reference: LLMEngine) -> None:
    decode = next(w for w in own_stack.workers if w.name.startswith("decode"))
    client = _client(own_stack, checked=False)  # read as it comes: the kill is mid-stream
    [want] = reference.generate([LONG], SamplingParams(max_tokens=300, ignore_eos=True))
    stream = client.completions.create(model="tiny", prompt=LONG, max_tokens=300,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    started = time.monotonic()
    chunks = []
    error = ""
    try:
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                decode.kill()
    except openai.APIError as e:
        error = str(e)
    assert time.monotonic() - started < 20, "never a hang"
    # U+FFFD aside: a stream renders the random model's lone UTF-8 bytes its own way.
    text = "".join(c.choices[0].text for c in chunks if c.choices).replace("\ufffd", "")
    whole = want.text.replace("\ufffd", "")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    # What the client got is what the model says, as far as it went: nothing lost or repeated.
    assert len(chunks) >= 3 and whole.startswith(text), (text, whole)
    if error:  # the stream said why it ended, and never claimed to be whole
        assert "decode worker" in error and not any(finishes), (error, finishes)
        assert text != whole
    else:  # every token arrived before the kill took effect: all 300 of them, and it says so
        assert text == whole and finishes[-1] == "length", finishes[-3:]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 300
    # With no decode worker left, new requests fail fast with a clear 503.
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert failed.value.status_code == 503


def _stats(url: str) -> dict[str, float]:
    import urllib.request

    return dict(json.loads(urllib.request.urlopen(url + "/internal/stats").read()))


def test_client_disconnect_frees_the_request_everywhere(stack: Stack) -> None:
    decode = next(w for w in stack.workers if w.name.startswith("decode"))
    stream = _client(stack, checked=False).completions.create(  # read as it comes
        model="tiny", prompt=LONG, max_tokens=300, temperature=0, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    assert _stats(decode.url)["running"] == 1  # still generating when the client leaves
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = _stats(decode.url)
        if s["running"] == 0 and s["kv_usage"] == 0:
            break
        time.sleep(0.05)
    s = _stats(decode.url)
    assert s["running"] == 0 and s["kv_usage"] == 0, s


@pytest.fixture(scope="module")
def guarded_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("guarded")
    key = logs / "api-key"
    key.write_text("s3cret-key\n")
    s = start_stack(tiny_model_dir, logs, prefill=0,
                    router_args=("--api-key-file", str(key), "--max-concurrent-requests", "1"))
    yield s
    s.stop()


def test_api_key_is_required_when_configured(guarded_stack: Stack) -> None:
    for key in ("wrong", ""):
        client = openai.OpenAI(base_url=guarded_stack.base_url, api_key=key or "x",
                               max_retries=0, default_headers={} if key else
                               {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
    ok = openai.OpenAI(base_url=guarded_stack.base_url, api_key="s3cret-key", max_retries=0)
    assert ok.completions.create(model="tiny", prompt="x", max_tokens=2).choices
    assert guarded_stack.router is not None
    assert "s3cret-key" not in guarded_stack.router.log.read_text()


def test_overload_answers_429_with_retry_after(guarded_stack: Stack) -> None:
    client = openai.OpenAI(base_url=guarded_stack.base_url, api_key="s3cret-key",
                           max_retries=0)
    busy = client.completions.create(model="tiny", prompt=LONG, max_tokens=300, temperature=0,
                                     stream=True)
    next(iter(busy))  # the only slot is now taken
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert limited.value.response.headers.get("retry-after") == "1"
    busy.close()
    deadline = time.monotonic() + 10
    while True:  # the slot frees once the router notices the disconnect
        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_kv_transfer_is_measured_on_both_sides(stack: Stack) -> None:
    prefill = next(w for w in stack.workers if w.name.startswith("prefill"))
    decode = next(w for w in stack.workers if w.name.startswith("decode"))
    saved = _metric(prefill.url, f'{TRANSFERRED}{{direction="save"')
    loaded = _metric(decode.url, f'{TRANSFERRED}{{direction="load"')
    fresh = f"{time.time_ns()} " + LONG  # a new first block: nothing of it is cached anywhere
    _client(stack).completions.create(model="tiny", prompt=fresh, max_tokens=2)
    assert _metric(prefill.url, f'{TRANSFERRED}{{direction="save"') > saved
    assert _metric(decode.url, f'{TRANSFERRED}{{direction="load"') > loaded


def test_sigterm_drains_in_flight_requests(own_stack: Stack) -> None:
    import signal as sig

    decode = next(w for w in own_stack.workers if w.name.startswith("decode"))
    stream = _client(own_stack, checked=False).completions.create(  # read as it comes
        model="tiny", prompt=SHORT, max_tokens=480, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    decode.proc.send_signal(sig.SIGTERM)  # mid-request: it must finish, not be cut off
    rest = [c for c in chunks if c.choices]
    assert rest and rest[-1].choices[0].finish_reason == "length"
    assert decode.proc.wait(timeout=15) == 0  # then the worker exits on its own
    draining = decode.log.read_text()
    assert "draining" in draining and "grace period over" not in draining


def test_fail_policy_refuses_instead_of_recomputing(tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    s = start_stack(tiny_model_dir, tmp_path,
                    router_args=("--kv-load-failure-policy", "fail"))
    try:
        client = _client(s)
        assert client.completions.create(model="tiny", prompt=LONG, max_tokens=3).choices
        s.redis.kill()
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="tiny", prompt=f"{time.time_ns()} " + LONG,
                                      max_tokens=3)
        assert refused.value.status_code == 503
        assert "kv_load_failure_policy" in str(refused.value)
    finally:
        s.stop()


def test_router_discovers_workers_through_dns(tiny_model_dir: Path, tmp_path: Path,
                                              reference: LLMEngine) -> None:
    s = start_stack(tiny_model_dir, tmp_path, dns=True)
    try:
        got = _client(s).completions.create(model="tiny", prompt=LONG, max_tokens=6,
                                            temperature=0)
        [want] = reference.generate([LONG], SamplingParams(max_tokens=6))
        assert got.choices[0].text == want.text
        assert s.router is not None
        assert _metric(s.router.url, f'{DECISIONS}{{path="disaggregated"') == 1
    finally:
        s.stop()


def test_a_mostly_cached_prompt_skips_the_separate_prefill(stack: Stack) -> None:
    assert stack.router is not None
    name = f'{DECISIONS}{{path="decode_only",reason="mostly_cached"}}'
    before = _metric(stack.router.url, name)
    fresh = f"{time.time_ns()} " + LONG
    client = _client(stack)
    client.completions.create(model="tiny", prompt=fresh, max_tokens=2)  # blocks now stored
    assert _metric(stack.router.url, name) == before
    client.completions.create(model="tiny", prompt=fresh + " more", max_tokens=2)
    assert _metric(stack.router.url, name) == before + 1


@pytest.mark.parametrize("sampling", [{"top_k": 2.5}, {"max_tokens": True}, {"seed": "x"},
                                      {"stop": [1]}, {"temperature": "hot"}, {"stop": None},
                                      {"stop": "ab"}, {"stop_token_ids": 5},
                                      {"ignore_eos": "yes"}])
def test_worker_refuses_mistyped_sampling_and_stays_alive(stack: Stack,
                                                          sampling: dict[str, object]) -> None:
    decode = next(w for w in stack.workers if w.name.startswith("decode"))
    code, reply = post_raw(decode.url + "/internal/generate", json.dumps(
        {"prompt_token_ids": [5, 6, 7], "sampling": sampling}).encode())
    assert code == 400 and reply["error"]
    code, _ = post_raw(decode.url + "/internal/generate", json.dumps(
        {"prompt_token_ids": [5, 6, 7], "sampling": {}, "first_token": 10**9}).encode())
    assert code == 400  # a first token outside the vocabulary
    for body, why in (({"first_token": 5, "earlier_token_ids": "x"}, "earlier_token_ids"),
                      ({"earlier_token_ids": [1]}, "needs first_token"),
                      ({"first_token": 5, "earlier_token_ids": [10**9]}, "output token ids")):
        code, reply = post_raw(decode.url + "/internal/generate", json.dumps(
            {"prompt_token_ids": [5, 6, 7], "sampling": {}, **body}).encode())
        assert code == 400 and why in reply["error"]["message"], (body, reply)
    import urllib.request

    assert urllib.request.urlopen(decode.url + "/health").status == 200  # engine still alive
