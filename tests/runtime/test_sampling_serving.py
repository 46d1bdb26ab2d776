"""Sampling through the whole platform (issue 16 item 2), with the official ``openai`` client:
real worker processes (a prefill and a decode one), a real redis-server and the router.

n and best_of, penalties, logit bias, echo, prompt logprobs (with echo too), and the same
seeded output whether a request is disaggregated (the prefill worker samples the first token,
the decode worker the rest) or served whole by one worker, and whether it comes from a single
engine in this process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from response_support import checked_client
from serving_stack import Stack, start_stack
from test_serving import DECISIONS, _metric

from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sequence import SamplingParams

LONG = "the quick brown fox jumps over the lazy dog " * 6  # > 16 tokens: disaggregated
PENALTIES = {"frequency_penalty": 1.2, "presence_penalty": 0.4, "repetition_penalty": 1.3,
             "min_p": 0.05, "min_tokens": 6, "logit_bias": {"9": 4.0}}


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("sampling-logs"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                  kv_cache_bytes=1 << 23, num_threads=1),
                     progress=lambda _: None)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return checked_client(stack.base_url)  # every response held to the schema


def _engine_params(max_tokens: int, seed: int, temperature: float) -> SamplingParams:
    rules = {k: v for k, v in PENALTIES.items() if k != "logit_bias"}
    return SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature,
                          logit_bias=((9, 4.0),), **rules)  # type: ignore[arg-type]


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_disaggregated_and_whole_give_the_engine_s_seeded_output(
        stack: Stack, client: openai.OpenAI, reference: LLMEngine) -> None:
    assert stack.router is not None
    prompt = f"{time.time_ns()} {LONG}"  # not cached yet: the first request is disaggregated
    disaggregated = f'{DECISIONS}{{path="disaggregated"'
    before = _metric(stack.router.url, disaggregated)
    texts = [client.completions.create(model="tiny", prompt=prompt, max_tokens=12, seed=5,
                                       temperature=0.8, extra_body=PENALTIES).choices[0].text
             for _ in range(2)]
    # The first was split; the second found the prompt cached and was served whole.
    assert _metric(stack.router.url, disaggregated) == before + 1
    [want] = reference.generate([prompt], _engine_params(12, 5, 0.8))
    assert texts == [want.text, want.text]
    [plain] = reference.generate([prompt], SamplingParams(max_tokens=12, seed=5,
                                                          temperature=0.8))
    assert plain.text != want.text  # the rules changed the output


def test_penalties_reduce_repeats(client: openai.OpenAI, reference: LLMEngine) -> None:
    """The served text is the engine's, token for token (its ids counted here), and the
    penalized one repeats less."""
    strong = {"frequency_penalty": 2.0, "presence_penalty": 2.0}
    served = [client.completions.create(model="tiny", prompt=LONG, max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True, **extra}
                                        ).choices[0].text for extra in ({}, strong)]
    plain, penalized = reference.generate(
        [LONG, LONG], [SamplingParams(max_tokens=24, ignore_eos=True),
                       SamplingParams(max_tokens=24, ignore_eos=True, **strong)])
    assert served == [plain.text, penalized.text]
    assert _repeats(penalized.token_ids) < _repeats(plain.token_ids)


def test_logit_bias_forces_a_token(client: openai.OpenAI, reference: LLMEngine) -> None:
    got = client.completions.create(model="tiny", prompt=LONG, max_tokens=5, temperature=0,
                                    logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert got.choices[0].text == reference.tokenizer.decode([42] * 5)


def test_n_gives_n_choices_each_seeded_as_its_own_request(client: openai.OpenAI) -> None:
    got = client.completions.create(model="tiny", prompt=LONG, max_tokens=8, temperature=1.0,
                                    seed=100, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    texts = [c.text for c in got.choices]
    assert len(set(texts)) > 1  # different seeds, different samples
    for i, text in enumerate(texts):  # choice i is seeded seed + i, as vLLM's children
        alone = client.completions.create(model="tiny", prompt=LONG, max_tokens=8,
                                          temperature=1.0, seed=100 + i)
        assert alone.choices[0].text == text
    assert got.usage is not None
    assert got.usage.completion_tokens == sum(
        len(client.completions.create(model="tiny", prompt=LONG, max_tokens=8, temperature=1.0,
                                      seed=100 + i, logprobs=0).choices[0].logprobs.tokens
            or []) for i in range(3))  # type: ignore[union-attr]


def test_n_computes_the_prompt_once(stack: Stack, client: openai.OpenAI) -> None:
    """Sequence 0 prefills (disaggregated, its KV to the store); the others start once it has,
    and find the prompt cached: served whole from the cached blocks, not prefilled again."""
    assert stack.router is not None
    prompt = f"{time.time_ns()} {LONG}"
    split = f'{DECISIONS}{{path="disaggregated"'
    cached = f'{DECISIONS}{{path="decode_only",reason="mostly_cached"}}'
    before = (_metric(stack.router.url, split), _metric(stack.router.url, cached))
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, n=3, seed=1)
    assert len(got.choices) == 3
    assert (_metric(stack.router.url, split), _metric(stack.router.url, cached)) == (
        before[0] + 1, before[1] + 2)


def test_streamed_chat_with_n_sends_each_choice_with_its_index(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": LONG}]
    whole = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=8, temperature=1.0, seed=3, n=2)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=1.0,  # type: ignore[arg-type]
        seed=3, n=2, stream=True, stream_options={"include_usage": True}))
    texts = ["", ""]
    finished = set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_best_of_returns_the_likeliest(client: openai.OpenAI) -> None:
    got = client.completions.create(model="tiny", prompt=LONG, max_tokens=6, temperature=1.0,
                                    seed=40, best_of=3, n=1)
    assert len(got.choices) == 1 and got.choices[0].logprobs is None  # not asked for
    candidates = []
    for i in range(3):
        one = client.completions.create(model="tiny", prompt=LONG, max_tokens=6,
                                        temperature=1.0, seed=40 + i, logprobs=0).choices[0]
        assert one.logprobs is not None
        candidates.append((sum(one.logprobs.token_logprobs or []), one.text))
    assert got.choices[0].text == max(candidates)[1]


def test_echo_puts_the_prompt_in_front(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="tiny", prompt=LONG, max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=LONG, max_tokens=4, temperature=0,
                                       echo=True, n=2)
    assert [c.text for c in echoed.choices] == [LONG + plain.choices[0].text] * 2
    streamed = client.completions.create(model="tiny", prompt=LONG, max_tokens=4,
                                         temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # not the model's token id
    ({"stop_token_ids": [99999999]}, "stop_token_ids"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),  # beyond the 20 logprobs takes too
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
])
def test_bad_values_get_a_400_naming_the_field(client: openai.OpenAI, fields: dict[str, object],
                                               param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="hi", extra_body=fields)
    body = refused.value.body
    assert isinstance(body, dict) and body.get("param") == param, body


def _prompt_scores(choice_or_body: Any) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs, which the openai client keeps as an extra field."""
    scores = (choice_or_body.model_extra or {}).get("prompt_logprobs")
    assert isinstance(scores, list), choice_or_body
    return scores


def test_prompt_logprobs_are_transformers_and_the_same_split_or_whole(
        stack: Stack, client: openai.OpenAI, reference: LLMEngine, tiny_hf_model: Any) -> None:
    assert stack.router is not None
    prompt = f"{time.time_ns()} {LONG}"  # not cached: disaggregated
    disaggregated = f'{DECISIONS}{{path="disaggregated"'
    before = _metric(stack.router.url, disaggregated)
    split = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, n=2,
                                      extra_body={"prompt_logprobs": 3})
    assert _metric(stack.router.url, disaggregated) == before + 1  # sequence 0 was split
    # Logprobs are served whole: the same prompt's scores from the decode worker alone.
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, logprobs=1,
                                      extra_body={"prompt_logprobs": 3})
    scores = _prompt_scores(split.choices[0])
    assert _prompt_scores(split.choices[1]) == scores  # every choice shows them
    ids = reference.tokenizer.encode(prompt)
    with torch.inference_mode():
        ref = torch.log_softmax(tiny_hf_model(torch.tensor([ids])).logits[0].float(), -1)
    assert scores[0] is None and len(scores) == len(ids)
    for p, (entry, other) in enumerate(zip(scores[1:], _prompt_scores(whole.choices[0])[1:],
                                           strict=True)):
        assert entry is not None and other is not None and entry.keys() == other.keys()
        row, token = ref[p], str(ids[p + 1])
        assert list(entry)[1:] == [str(t) for t in row.topk(3).indices.tolist()
                                   if str(t) != token][:len(entry) - 1]
        assert next(iter(entry)) == token  # the prompt's own token first, as vLLM's
        assert entry[token]["rank"] == int((row > row[ids[p + 1]]).sum()) + 1
        assert entry[token]["decoded_token"] == reference.tokenizer.decode([ids[p + 1]])
        for t, got in entry.items():
            assert got["logprob"] == pytest.approx(float(row[int(t)]), abs=1e-4)
            assert other[t]["logprob"] == pytest.approx(got["logprob"], abs=1e-5)


def test_chat_prompt_logprobs_are_its_template_s_prompt_s(client: openai.OpenAI,
                                                          reference: LLMEngine) -> None:
    messages = [{"role": "user", "content": LONG}]
    chat = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=1, extra_body={"prompt_logprobs": 2})
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)
    ids = reference.tokenizer.encode(text, add_special_tokens=False)
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=1,
                                      extra_body={"prompt_logprobs": 2})
    assert _prompt_scores(chat) == _prompt_scores(plain.choices[0])  # on the body, as vLLM's
    assert chat.usage is not None and len(_prompt_scores(chat)) == chat.usage.prompt_tokens


def test_echo_with_logprobs_scores_the_prompt_then_the_output(client: openai.OpenAI) -> None:
    asked = {"model": "tiny", "prompt": LONG, "max_tokens": 4, "temperature": 0, "echo": True,
             "logprobs": 2}
    [choice] = client.completions.create(**asked).choices  # type: ignore[call-overload]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    scores = _prompt_scores(client.completions.create(
        model="tiny", prompt=LONG, max_tokens=1, extra_body={"prompt_logprobs": 2}).choices[0])
    prompt_len = len(scores)
    assert len(lp.tokens) == prompt_len + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before it
    for got, top, want in zip(lp.token_logprobs[1:prompt_len], lp.top_logprobs[1:prompt_len],
                              scores[1:], strict=True):
        assert want is not None and got == pytest.approx(next(iter(want.values()))["logprob"])
        # The likeliest 2 by their text (two tokens may read the same: one key, as OpenAI's).
        assert set(top) == {v["decoded_token"] for v in want.values() if v["rank"] <= 2}
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(LONG)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**asked, stream=True):  # type: ignore[call-overload]
        for key, values in streamed.items():
            values += getattr(chunk.choices[0].logprobs, key) if chunk.choices[0].logprobs \
                else []
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                        "text_offset": lp.text_offset}
