"""vLLM's server surface on the router (issue 16): /tokenize, /detokenize, /version, /v1/models
with max_model_len, the BOS a completion's text prompt gets, and a chat template's refusal as
an OpenAI 400. A real router over HTTP; none of this reaches a worker (none listens)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from cleave.runtime.serving.router import Router, RouterConfig

MAX_LEN = 512
TEXT = "hello there"
# As Mistral's and Llama 2's templates refuse a conversation that does not alternate.
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/"
               "assistant/...') }}{% endif %}{{ m['content'] }}{% endfor %}")


class _WithBos:
    """The tiny tokenizer adds no special tokens; a Llama's adds a BOS. This one does."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.bos = int(inner.bos_token_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self._inner.encode(text, add_special_tokens=False))
        return [self.bos, *ids] if add_special_tokens else ids


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> _WithBos:
    return _WithBos(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


Client = Callable[[TestClient[Any, Any]], Awaitable[None]]


def _run(tokenizer: Any, test: Client) -> None:
    router = Router(RouterConfig(model="tiny", decode_urls=("http://127.0.0.1:9",),
                                 model_source="org/tiny-llama"), tokenizer, MAX_LEN, 512)

    async def go() -> None:
        async with TestClient(TestServer(router.app())) as client:
            await test(client)

    asyncio.run(go())


def _schema(doc: dict[str, Any], path: str, part: str) -> dict[str, Any]:
    op = doc["paths"][path]["post" if "post" in doc["paths"][path] else "get"]
    where = op["requestBody"] if part == "request" else op["responses"]["200"]
    return {**where["content"]["application/json"]["schema"], "components": doc["components"]}


def test_tokenize_and_detokenize_as_vllms(tokenizer: _WithBos) -> None:
    plain = tokenizer.encode(TEXT, add_special_tokens=False)

    async def test(client: TestClient[Any, Any]) -> None:
        doc = await (await client.get("/openapi.json")).json()
        requests: list[dict[str, Any]] = [
            {"model": "tiny", "prompt": TEXT}, {"prompt": TEXT, "add_special_tokens": False},
            {"messages": [{"role": "user", "content": TEXT}]}]
        got = []
        for body in requests:
            jsonschema.validate(body, _schema(doc, "/tokenize", "request"))
            r = await client.post("/tokenize", json=body)
            assert r.status == 200, await r.text()
            reply = await r.json()
            jsonschema.validate(reply, _schema(doc, "/tokenize", "response"))
            assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == MAX_LEN
            got.append(reply["tokens"])
        assert got[0] == [tokenizer.bos, *plain]  # a prompt gets the BOS, as generation does
        assert got[1] == plain
        assert tokenizer.bos not in got[2]  # the template's own tokens only
        assert TEXT in tokenizer.decode(got[2])
        r = await client.post("/detokenize", json={"model": "tiny", "tokens": plain})
        assert (await r.json()) == {"prompt": TEXT}
        r = await client.post("/detokenize", json={"tokens": [512]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"
        r = await client.post("/tokenize", json={"model": "other", "prompt": TEXT})
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        version = await (await client.get("/version")).json()
        assert isinstance(version["version"], str) and version["version"]

    _run(tokenizer, test)


def test_a_completion_counts_the_bos_it_adds(tokenizer: _WithBos) -> None:
    n = len(tokenizer.encode(TEXT, add_special_tokens=False))

    async def test(client: TestClient[Any, Any]) -> None:
        # Room for the prompt without a BOS and not one token more: refused only with it.
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": TEXT,
                                                       "max_tokens": MAX_LEN - n})
        error = (await r.json())["error"]
        assert r.status == 400 and error["code"] == "context_length_exceeded"
        assert f"the prompt has {n + 1} tokens" in error["message"]

    _run(tokenizer, test)


def test_models_and_template_errors_through_the_openai_client(tiny_model_dir: Path) -> None:
    strict = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    strict.chat_template = ALTERNATING

    async def test(client: TestClient[Any, Any]) -> None:
        api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                                 max_retries=0)
        [model] = (await api.models.list()).data
        assert model.id == "tiny"
        assert model.model_extra is not None
        assert model.model_extra["max_model_len"] == MAX_LEN
        assert model.model_extra["root"] == "org/tiny-llama"
        with pytest.raises(openai.BadRequestError) as refused:
            await api.chat.completions.create(model="tiny", messages=[
                {"role": "assistant", "content": "I speak first"}])
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "messages"
        assert "alternate" in error["message"]
        r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"},
                                                              {"role": "user", "content": "b"}]})
        assert r.status == 400  # the same refusal where the template is applied for counting

    _run(strict, test)


def test_vllms_extensions_are_refused_by_name_through_the_client(tokenizer: _WithBos) -> None:
    async def test(client: TestClient[Any, Any]) -> None:
        api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused",
                                 max_retries=0)
        for extra in ({"prompt_logprobs": 21}, {"structural_tag": "{}"}, {"max_token": 5}):
            with pytest.raises(openai.BadRequestError) as refused:
                await api.completions.create(model="tiny", prompt=TEXT, extra_body=extra)
            error = refused.value.body
            assert isinstance(error, dict) and error["param"] == next(iter(extra))

    _run(tokenizer, test)
