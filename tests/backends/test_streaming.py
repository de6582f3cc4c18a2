"""Streaming out of the engines: listeners hear every token as it is appended, `stream_batch`
turns a batch into per-request events, early finishers get their result at once, streamed text
never shows what a stop string cuts off, and the engine queue turns waiting requests into batches."""

import asyncio
import threading

import pytest

from backends.generation import GenerationRequest
from backends.speculative.drafters import NgramDrafter
from backends.speculative.engine import SpeculativeEngine
from backends.streaming import Done, StreamEvent, TextStream, stream_batch

COPY = "Repeat exactly: red green blue red green blue red green blue"


def requests() -> list[GenerationRequest]:
    return [
        GenerationRequest(messages=[{"role": "user", "content": COPY}], max_tokens=12),
        GenerationRequest(prompt="Once upon a time", max_tokens=3),
        GenerationRequest(prompt="1, 2, 3, 4,", max_tokens=16, stop=[" 7"]),
    ]


def collect(run, reqs, tokenizer) -> tuple[list[list[StreamEvent]], list[int]]:
    """Events per request, and how many requests were still running at each yield."""

    async def go():
        events: list[list[StreamEvent]] = [[] for _ in reqs]
        running = []
        async for item in stream_batch(run, reqs, tokenizer):
            assert len(item) == len(reqs)
            running.append(sum(x is not Done for x in item))
            for i, x in enumerate(item):
                if isinstance(x, StreamEvent):
                    events[i].append(x)
        return events, running

    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "speculative"])
def test_streamed_tokens_and_text_equal_the_result(kind, loaded, engine, tokenizer):
    eng = engine if kind == "plain" else SpeculativeEngine(loaded, NgramDrafter(), k=4)
    reqs = requests()
    reference = engine.generate(reqs)
    events, running = collect(eng.generate, reqs, tokenizer)
    for i, evs in enumerate(events):
        final = [e.result for e in evs if e.result is not None]
        assert len(final) == 1 and evs[-1].result is final[0]  # the result comes last, once
        assert [t for e in evs for t in e.token_ids] == final[0].token_ids == reference[i].token_ids
        assert "".join(e.text for e in evs) == final[0].text == reference[i].text
        assert (final[0].speculation is not None) == (kind == "speculative")
    assert reference[2].finish_reason == "stop" and " 7" not in reference[2].text
    # The 3-token request ended first: later yields carried it as done, not as news.
    assert running[-1] == 0 and min(running[:-1]) < len(reqs) <= max(running)


@pytest.mark.slow
def test_an_early_finisher_gets_its_result_before_the_batch_ends(engine, tokenizer):
    reqs = [GenerationRequest(prompt="Hello", max_tokens=2), GenerationRequest(prompt="Hello", max_tokens=24)]

    async def go():
        seen = []
        async for item in stream_batch(engine.generate, reqs, tokenizer):
            if isinstance(item[0], StreamEvent) and item[0].result is not None:
                seen.append(("short done", item[1] is None or item[1].result is None))
        return seen

    seen = asyncio.run(go())
    assert seen == [("short done", True)]  # the long one was still running


def test_an_engine_error_reaches_the_caller(tokenizer):
    def broken(reqs, listeners):
        raise RuntimeError("engine broke")

    async def go():
        async for _ in stream_batch(broken, [GenerationRequest(prompt="x", max_tokens=2)], tokenizer):
            pass

    with pytest.raises(RuntimeError, match="engine broke"):
        asyncio.run(go())


@pytest.mark.slow
def test_the_engine_runs_off_the_event_loop(engine, tokenizer):
    threads = []

    def run(reqs, listeners):
        threads.append(threading.current_thread())
        return engine.generate(reqs, listeners)

    collect(run, [GenerationRequest(prompt="Hi", max_tokens=2)], tokenizer)
    assert threads and threads[0] is not threading.main_thread()


def test_text_stream_never_shows_what_a_stop_string_may_cut(tokenizer):
    ids = tokenizer("abc STO", add_special_tokens=False).input_ids
    stream = TextStream(tokenizer, ["STOP"])
    shown = "".join(stream.delta(ids[: n + 1]) for n in range(len(ids)))
    assert shown == "abc "  # "STO" may become "STOP": held back
    assert shown + stream.final("abc ") == "abc "  # the engine cut the text at the stop string


def test_text_stream_waits_for_a_whole_character(tokenizer):
    ids = tokenizer("🦀", add_special_tokens=False).input_ids
    assert len(ids) >= 2  # one character over several byte-level tokens
    stream = TextStream(tokenizer, [])
    parts = [stream.delta(ids[: n + 1]) for n in range(len(ids))]
    assert "".join(parts) == "🦀" and all("\ufffd" not in p for p in parts)


class _FakeState:
    def __init__(self, request, token_ids):
        self.request, self.token_ids, self.finished = request, token_ids, True

    def result(self, tokenizer):
        from backends.generation import GenerationResult

        return GenerationResult(
            text="x",
            token_ids=self.token_ids,
            finish_reason="length",
            prompt_tokens=1,
            completion_tokens=1,
            ttft_s=0.0,
            tpot_s=0.0,
            seed=0,
        )


def test_the_engine_queue_takes_everything_waiting_when_the_engine_frees_up(tokenizer):
    import time as clock

    from backends.streaming import EngineQueue

    def run(reqs, listeners):
        clock.sleep(0.3)  # a busy engine: requests keep arriving meanwhile
        for request, listener in zip(reqs, listeners, strict=True):
            listener(_FakeState(request, [7]), 7)
        return []

    queue = EngineQueue(run, tokenizer, max_batch=4, wait_s=0.01)

    async def one(delay):
        await asyncio.sleep(delay)
        return [e async for e in queue.submit(GenerationRequest(prompt="x", max_tokens=1))]

    async def go():
        return await asyncio.gather(*[one(0.05 * (i > 0)) for i in range(7)])

    results = asyncio.run(go())
    assert all(len(r) == 1 and r[0].result is not None for r in results)
    # 1 alone, then the 6 that queued behind it: 4 (max_batch) and 2.
    assert queue.batch_sizes == [1, 4, 2]


def test_the_engine_queue_passes_an_engine_failure_to_every_request(tokenizer):
    from backends.streaming import EngineQueue

    def run(reqs, listeners):
        raise RuntimeError("engine broke")

    queue = EngineQueue(run, tokenizer, max_batch=4, wait_s=0.01)

    async def one():
        return [e async for e in queue.submit(GenerationRequest(prompt="x", max_tokens=1))]

    async def go():
        return await asyncio.gather(one(), one(), return_exceptions=True)

    outcomes = asyncio.run(go())
    assert [str(o) for o in outcomes] == ["engine broke", "engine broke"]
