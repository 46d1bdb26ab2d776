"""``--prompt-tokens-details hide``: responses carry no ``cached_tokens`` (vLLM's default,
without ``--enable-prompt-tokens-details``), whole or streamed; ``show`` (Cleave's default)
reports them. Real worker and router processes, the official ``openai`` client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from serving_stack import Stack, start_stack

from cleave.common.settings import RoutingSettings

PROMPT = "the quick brown fox jumps over the lazy dog " * 8


@pytest.fixture(scope="module", params=["show", "hide"])
def stack(request: pytest.FixtureRequest, tiny_model_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Stack]]:
    # The flag as `cleave up` and the operator write it: from the settings class.
    args = RoutingSettings(prompt_tokens_details=request.param).to_args()
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("details"), prefill=0,
                    router_args=tuple(args))
    yield request.param, s
    s.stop()


def test_cached_tokens_are_shown_or_hidden(stack: tuple[str, Stack]) -> None:
    mode, s = stack
    client = openai.OpenAI(base_url=s.base_url, api_key="-", max_retries=0, timeout=60)
    text = f"{time.time_ns()} " + PROMPT
    client.completions.create(model="tiny", prompt=text, max_tokens=2)  # now it is cached
    whole = client.completions.create(model="tiny", prompt=text, max_tokens=2)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    streamed = chunks[-1].usage
    assert whole.usage is not None and streamed is not None
    assert whole.usage.prompt_tokens > 16 and streamed.prompt_tokens > 16
    if mode == "hide":
        assert whole.usage.prompt_tokens_details is None
        assert streamed.prompt_tokens_details is None
    else:
        assert whole.usage.prompt_tokens_details is not None
        # Every full block but the one holding the last token (always recomputed).
        want = (whole.usage.prompt_tokens - 1) // 16 * 16
        assert whole.usage.prompt_tokens_details.cached_tokens == want
        assert streamed.prompt_tokens_details is not None


def test_the_flag_round_trips() -> None:
    assert RoutingSettings().to_args() == []  # showing them is the default
    hidden = RoutingSettings(prompt_tokens_details="hide")
    assert hidden.to_args() == ["--prompt-tokens-details=hide"]
