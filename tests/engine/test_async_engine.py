"""The engine on its own thread, driven from asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest

from loraplex import SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import EngineConfig
from loraplex.errors import InvalidRequestError, UnknownAdapterError


@pytest.fixture(params=[False, True], ids=["sync-steps", "async-steps"])
def engine(tiny_llama, request):
    model, adapters = tiny_llama
    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(str(model), device="cpu", block_size=4,
                                                            async_scheduling=request.param)))
    asyncio.run(engine.add_adapter("all8", adapters["all8"]))
    yield engine
    engine.shutdown()


async def _collect(engine, request_id, prompt, adapter=None, max_tokens=6):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o async for o in engine.generate(request_id, prompt_token_ids=prompt, params=params,
                                             adapter=adapter)]


def test_concurrent_streams_match_offline_results(engine):
    async def main():
        return await asyncio.gather(*(
            _collect(engine, f"r{i}", [5 + i, 6, 7], adapter="all8" if i % 2 else None) for i in range(6)))

    streams = asyncio.run(main())
    for outputs in streams:  # one output a step, or several merged if the caller fell behind
        lengths = [len(o.token_ids) for o in outputs]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 6
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids
    expected = asyncio.run(_collect(engine, "again", [6, 6, 7], adapter="all8"))
    assert streams[1][-1].token_ids == expected[-1].token_ids


def test_outputs_that_pile_up_come_merged(engine):
    async def main():
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        stream = engine.generate("behind", prompt_token_ids=[5, 6, 7], params=params)
        outputs = [await anext(stream)]
        await engine.call(lambda e: None)
        time.sleep(1.0)  # the event loop is busy: the engine's outputs pile up
        return outputs + [o async for o in stream]

    outputs = asyncio.run(main())
    assert len(outputs) < 40
    assert max(len(o.new_token_ids) for o in outputs) > 1
    assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids
    assert len(outputs[-1].token_ids) == 40 and outputs[-1].finished


def test_invalid_requests_raise_to_the_caller(engine):
    with pytest.raises(UnknownAdapterError):
        asyncio.run(_collect(engine, "x", [5], adapter="missing"))
    with pytest.raises(InvalidRequestError, match="already in use"):
        async def twice():
            first = engine.generate("dup", prompt_token_ids=[5], params=SamplingParams(max_tokens=50))
            await first.__anext__()
            await _collect(engine, "dup", [5])
        asyncio.run(twice())
    assert engine.is_alive


def test_leaving_a_stream_early_aborts_the_request(engine):
    async def main():
        stream = engine.generate("early", prompt_token_ids=[5, 6], params=SamplingParams(
            max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()  # queues the abort; commands run in order, so the next call sees it
        return await engine.call(lambda e: (e.num_requests, e.blocks.num_used_blocks))

    assert asyncio.run(main()) == (0, 0)


def test_shutdown_ends_streams_that_are_still_waiting(tiny_llama):
    from loraplex.engine.async_engine import EngineDeadError

    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(str(tiny_llama[0]), device="cpu")))

    async def main():
        stream = engine.generate("long", prompt_token_ids=[5, 6], params=SamplingParams(
            max_tokens=100000, ignore_eos=True))
        await stream.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert not engine.is_alive
    # The thread left the engine idle: a new one (a new server's) starts clean and serves.
    llm = engine.engine
    assert llm.num_requests == 0 and not llm.has_unfinished_requests()
    assert llm.blocks.num_used_blocks == 0
    successor = AsyncEngine(llm)
    try:
        outputs = asyncio.run(_collect(successor, "next", [5, 6, 7], max_tokens=3))
        assert outputs[-1].finished and len(outputs[-1].token_ids) == 3
    finally:
        successor.shutdown()
