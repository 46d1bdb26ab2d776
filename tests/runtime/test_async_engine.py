"""The asyncio front: token streams, early exit aborts, errors surface at once."""

from __future__ import annotations

import asyncio

import pytest

from cleave.runtime.engine.async_engine import AsyncEngine
from cleave.runtime.engine.sequence import FinishReason, RequestError, SamplingParams


async def test_concurrent_streams_match_offline(tiny_engine_factory) -> None:
    prompts = [[7, 8, 9, 10] * k for k in (1, 5, 12)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [r.token_ids for r in tiny_engine_factory().generate(prompts, params)]
    engine = AsyncEngine(tiny_engine_factory())
    try:
        async def collect(prompt: list[int]) -> tuple[list[int], int]:
            tokens: list[int] = []
            deltas = 0
            async for out in engine.generate(prompt, params):
                tokens += out.new_token_ids
                deltas += 1
                if out.finished:
                    assert out.finish_reason is FinishReason.LENGTH
            return tokens, deltas

        results = await asyncio.gather(*(collect(p) for p in prompts))
        assert [tokens for tokens, _ in results] == expected
        assert all(deltas == 12 for _, deltas in results)  # one delta per token: a stream
    finally:
        engine.shutdown()


async def test_leaving_the_stream_aborts_and_frees_blocks(tiny_engine_factory) -> None:
    engine = AsyncEngine(tiny_engine_factory())
    try:
        stream = engine.generate([5] * 40, SamplingParams(max_tokens=400, ignore_eos=True))
        async for out in stream:
            assert engine.engine.kv_usage_ratio() > 0
            if out.num_output_tokens >= 3:
                break
        await stream.aclose()
        for _ in range(100):
            if engine.engine.kv_usage_ratio() == 0 and not engine.engine.has_unfinished:
                break
            await asyncio.sleep(0.02)
        assert engine.engine.kv_usage_ratio() == 0
        assert not engine.engine.has_unfinished
    finally:
        engine.shutdown()


async def test_bad_request_raises_before_streaming(tiny_engine_factory) -> None:
    engine = AsyncEngine(tiny_engine_factory())
    try:
        with pytest.raises(RequestError, match="empty"):
            async for _ in engine.generate([], SamplingParams()):
                pass
        outs = [o async for o in engine.generate([3, 4], SamplingParams(max_tokens=2,
                                                                         ignore_eos=True))]
        assert outs[-1].finished and outs[-1].num_output_tokens == 2
    finally:
        engine.shutdown()


async def test_a_dying_engine_fails_every_request_and_refuses_new_ones(tiny_engine_factory,
                                                                      monkeypatch) -> None:
    from cleave.runtime.engine.async_engine import EngineDeadError

    core = tiny_engine_factory()

    def broken_step() -> list[object]:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(core, "step", broken_step)
    engine = AsyncEngine(core)
    try:
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            async for _ in engine.generate([3, 4, 5], SamplingParams(max_tokens=3)):
                pass
        assert engine.dead is not None
        with pytest.raises(EngineDeadError):  # fails at once instead of waiting forever
            await asyncio.wait_for(anext(engine.generate([3], SamplingParams())), timeout=5)
    finally:
        engine.shutdown()


async def test_a_request_in_flight_at_shutdown_ends_instead_of_hanging(tiny_engine_factory
                                                                      ) -> None:
    from cleave.runtime.engine.async_engine import EngineDeadError

    engine = AsyncEngine(tiny_engine_factory())
    stream = engine.generate([3, 4, 5], SamplingParams(max_tokens=400, ignore_eos=True))
    await anext(stream)  # running
    engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(_drain(stream), timeout=10)


async def _drain(stream) -> None:  # type: ignore[no-untyped-def]
    async for _ in stream:
        pass
