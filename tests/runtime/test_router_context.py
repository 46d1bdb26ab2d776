"""The router takes the context length from its workers' stats: a router whose own limit (its
--max-model-len, or the model's config) is larger than the workers' cannot admit prompts the
workers refuse, advertise a context they do not have, or default a chat's max_tokens past it.

Real processes: workers started with --max-model-len 64, a router without the flag (the tiny
model's config says 512), the official ``openai`` client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from serving_stack import Stack, post_raw, start_stack

WORKER_CONTEXT = 64  # the tiny model's config allows 512


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("context"),
                    worker_args=("--max-model-len", str(WORKER_CONTEXT)))
    yield s
    s.stop()


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="-", max_retries=0, timeout=60)


def test_the_router_advertises_the_workers_context(stack: Stack) -> None:
    [model] = _client(stack).models.list().data
    assert model.max_model_len == WORKER_CONTEXT  # type: ignore[attr-defined]
    status, body = post_raw(stack.router.url + "/tokenize",  # type: ignore[union-attr]
                            json.dumps({"prompt": "hi"}).encode())
    assert status == 200 and body["max_model_len"] == WORKER_CONTEXT


def test_a_chat_without_max_tokens_fills_the_workers_context(stack: Stack) -> None:
    done = _client(stack).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], temperature=0,
        extra_body={"ignore_eos": True})
    assert done.usage is not None
    assert done.usage.prompt_tokens + done.usage.completion_tokens == WORKER_CONTEXT
    assert done.choices[0].finish_reason == "length"


def test_a_prompt_past_the_workers_context_is_refused_by_the_router(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _client(stack).completions.create(model="tiny", prompt="a b c d e f g h " * 4,
                                          max_tokens=WORKER_CONTEXT)
    assert refused.value.code == "context_length_exceeded"
    assert f"context of {WORKER_CONTEXT} tokens" in str(refused.value)
