"""The served step loop: each request an async stream fed from the loop's thread, requests that
arrive while others decode join at the next step, a full backend refuses at once (429), a client
that leaves frees its row, and a failure reaches only its own stream."""

import asyncio
import time

import pytest

from backends.errors import Overloaded, RequestError
from backends.generation import GenerationRequest
from backends.scheduler import LoopSettings, Scheduler
from backends.serving import ServingLoop
from backends.speculative.drafters import NgramDrafter

from .conftest import BrokenDrafter, lookup


def _request(tokens: int, text: str = "Hello there", **fields) -> GenerationRequest:
    return GenerationRequest(prompt=text, max_tokens=tokens, ignore_eos=True, **fields)


async def _collect(loop: ServingLoop, request: GenerationRequest, drafter: str | None = None):
    events = [e async for e in loop.stream(request, drafter)]
    return events, time.perf_counter()


def test_streamed_tokens_and_text_add_up_to_the_result_of_decoding_alone(tiny_target):
    scheduler = Scheduler(tiny_target, LoopSettings(), [NgramDrafter()], k=2)
    request = _request(12, "1, 2, 3, 1, 2, 3,", stop=[" 9"])
    alone = Scheduler(tiny_target, LoopSettings()).generate([request])[0]
    events, _ = asyncio.run(_collect(ServingLoop(scheduler), request))
    result = events[-1].result
    assert result is not None and all(e.result is None for e in events[:-1])
    assert [t for e in events for t in e.token_ids] == result.token_ids == alone.token_ids
    assert "".join(e.text for e in events) == result.text == alone.text


def test_a_request_arriving_mid_decode_joins_and_finishes_first(tiny_target):
    loop = ServingLoop(Scheduler(tiny_target, LoopSettings()))

    async def go():
        long = asyncio.create_task(_collect(loop, _request(300)))
        await asyncio.sleep(0.3)
        short_events, short_done = await _collect(loop, _request(3))
        long_events, long_done = await long
        return short_events[-1].result, long_events[-1].result, short_done < long_done

    short, long, short_first = asyncio.run(go())
    assert short_first and len(short.token_ids) == 3 and len(long.token_ids) == 300
    assert short.ttft_s < long.ttft_s + 300 * long.tpot_s / 2  # it did not wait for the long one to end


def test_a_full_backend_refuses_at_once_with_a_retry_after(tiny_target):
    loop = ServingLoop(Scheduler(tiny_target, LoopSettings(max_batch=1, max_queued=1)))

    async def go():
        running = [asyncio.create_task(_collect(loop, _request(200))) for _ in range(2)]
        await asyncio.sleep(0.1)
        started = time.perf_counter()
        with pytest.raises(Overloaded) as refused:
            await _collect(loop, _request(2))
        waited = time.perf_counter() - started
        await asyncio.gather(*running)
        return refused.value, waited

    refused, waited = asyncio.run(go())
    assert refused.retry_after_s >= 1 and "full" in str(refused) and waited < 0.1


def test_a_client_that_leaves_frees_its_row(tiny_target):
    scheduler = Scheduler(tiny_target, LoopSettings())
    loop = ServingLoop(scheduler)

    async def go():
        stream = loop.stream(_request(1000))
        await anext(stream)
        await anext(stream)
        await stream.aclose()  # what Serve does when the HTTP client disconnects
        for _ in range(200):
            if scheduler.idle:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(go())
    assert scheduler.cache.sequences == {} and loop.outstanding == 0


def test_a_failure_reaches_only_its_own_stream(tiny_target):
    loop = ServingLoop(Scheduler(tiny_target, LoopSettings(), [lookup(), BrokenDrafter()], k=2))

    async def go():
        return await asyncio.gather(
            _collect(loop, _request(8), "ngram"), _collect(loop, _request(8), "broken"), return_exceptions=True
        )

    good, bad = asyncio.run(go())
    assert isinstance(bad, RuntimeError) and str(bad) == "drafter broke"
    assert len(good[0][-1].result.token_ids) == 8


def test_a_submission_that_fails_on_the_loop_thread_reaches_its_stream(tiny_target, monkeypatch):
    loop = ServingLoop(Scheduler(tiny_target, LoopSettings()))

    def broken_submit(*args, **kwargs):
        raise RuntimeError("submit broke")

    monkeypatch.setattr(loop.scheduler, "submit", broken_submit)
    with pytest.raises(RuntimeError, match="submit broke"):
        asyncio.run(asyncio.wait_for(_collect(loop, _request(4)), timeout=30))  # an error, never a hang
    assert loop.outstanding == 0


def test_a_request_the_loop_cannot_serve_is_refused_before_it_is_queued(tiny_target):
    loop = ServingLoop(Scheduler(tiny_target, LoopSettings(kv_cache_tokens=64)))
    with pytest.raises(RequestError, match="KV cache"):
        asyncio.run(_collect(loop, _request(500)))
    assert loop.outstanding == 0 and loop.thread is None


def test_closing_waits_for_the_step_in_progress_then_frees_the_engine(tiny_target, monkeypatch):
    scheduler = Scheduler(tiny_target, LoopSettings())
    freed: list[bool] = []
    monkeypatch.setattr(scheduler, "close", lambda: freed.append(scheduler.idle))
    loop = ServingLoop(scheduler)

    async def go():
        task = asyncio.create_task(_collect(loop, _request(500)))
        await asyncio.sleep(0.3)  # decoding: the loop's thread is mid-run
        loop.close()
        with pytest.raises(RuntimeError, match="closed its step loop"):
            await task

    asyncio.run(go())
    assert loop.thread is not None and not loop.thread.is_alive()
    assert freed == [True]  # freed once, after the thread stopped and nothing was left using the engine
    with pytest.raises(RuntimeError, match="the step loop is closed"):
        asyncio.run(_collect(loop, _request(3)))
