"""A decode resumed after its worker died mid-stream reads as if nothing had happened: the
tokens, the text (characters split across tokens, stop strings spanning the break) and the
counts are those of the uninterrupted request."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cleave.runtime.engine.detokenizer import IncrementalDetokenizer
from cleave.runtime.engine.outputs import KVHandoff
from cleave.runtime.engine.sequence import FinishReason, SamplingParams

TEXT = "I like 😀 and 日本語 ok, then E N D and more words after it"


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    out = ""
    for t in ids:
        detok.add([t])
        out += detok.take_delta(final=False)
    return out


@pytest.mark.parametrize("stop", [(), (" E N D",)], ids=["no-stop", "stop-string"])
def test_text_is_the_same_whatever_token_the_stream_broke_after(
        tiny_model_dir: Path, stop: tuple[str, ...]) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tok(TEXT)["input_ids"]
    assert len(ids) > len(TEXT.split())  # byte-level: some characters span several tokens
    whole = IncrementalDetokenizer(tok, stop)
    want = _stream(whole, ids) + whole.take_delta(final=True)
    assert want == (TEXT.split(" E N D")[0] if stop else TEXT)
    for k in range(1, len(ids)):
        before = IncrementalDetokenizer(tok, stop)
        sent = _stream(before, ids[:k])  # what the client had when the worker died
        if before.stopped:
            continue  # the request had ended: nothing to resume
        after = IncrementalDetokenizer(tok, stop)
        after.replay(ids[:k])
        got = sent + _stream(after, ids[k:]) + after.take_delta(final=True)
        assert got == want, k


def test_a_continuation_yields_the_rest_of_the_greedy_answer(tiny_engine_factory) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompt = list(range(40, 73))
    [whole] = tiny_engine_factory().generate([prompt], params)
    assert whole.text  # there is text to compare
    for k in (1, 6, 19):
        engine = tiny_engine_factory()
        sent = whole.token_ids[:k]
        kv = KVHandoff(block_hashes=[], blocks=[], first_token=sent[-1],
                       earlier_tokens=tuple(sent[:-1]))
        engine.add_request(f"resume-{k}", prompt, params, kv=kv)
        rest: list[int] = []
        rest_text = ""
        last = None
        while engine.has_unfinished:
            for out in engine.step():
                rest += out.new_token_ids
                rest_text += out.new_text
                last = out
        assert sent + rest == whole.token_ids, k
        # And the text: what the client had, then what the resumed engine sent, reads whole.
        had = _stream(IncrementalDetokenizer(engine.tokenizer), sent)
        assert had + rest_text == whole.text, k
        assert last is not None and last.finish_reason is FinishReason.LENGTH
        # Counted in the request's own terms: its prompt, and all of its output.
        assert (last.num_prompt_tokens, last.num_output_tokens) == (len(prompt), 20)


def test_a_break_after_the_last_token_finishes_at_once(tiny_engine_factory) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine = tiny_engine_factory()
    kv = KVHandoff(block_hashes=[], blocks=[], first_token=9, earlier_tokens=(5, 6, 7, 8))
    [out] = engine.enqueue(engine.make_sequence("done", [1, 2, 3], params, kv=kv), kv)
    assert out.finished and out.finish_reason is FinishReason.LENGTH
    assert out.new_token_ids == [] and out.num_output_tokens == 5  # nothing more to send
    assert not engine.has_unfinished
