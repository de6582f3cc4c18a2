"""Streaming out of engines: the events a request's stream carries (`StreamEvent`), the text a
stream may show so far (`TextStream`), and the static baseline — `stream_batch` runs a blocking
engine over a batch in a worker thread and yields, whenever anything arrived, one item per
request; `EngineQueue` batches a replica's requests and runs each batch to completion. The step
loop (`backends.serving`) is what serves; this queue is what `bench load --batching static`
measures it against. Nothing here imports Ray, so the same code is tested in-process.

A row that finishes early gets its result at once; it does not wait for the batch to end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pydantic import BaseModel, Field
from transformers import PreTrainedTokenizerBase

from .generation import GenerationRequest, GenerationResult, SequenceState, TokenListener

BatchRun = Callable[[Sequence[GenerationRequest], Sequence[TokenListener]], list[GenerationResult]]
Done = StopIteration  # marks, in `stream_batch`'s items, a request that has already ended


class StreamEvent(BaseModel):
    """New output of one request: text and token ids since the last event; `result` on the last."""

    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    result: GenerationResult | None = None
    error: str | None = Field(None, description="the backend refused the request: what to fix (a 4xx)")
    retry_after_s: int | None = Field(None, description="with `error`: the backend is full, retry after this long")

    def merge(self, later: StreamEvent) -> StreamEvent:
        return StreamEvent(
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            result=later.result or self.result,
            error=later.error or self.error,
            retry_after_s=later.retry_after_s or self.retry_after_s,
        )


class TextStream:
    """A sequence's text as it grows, never showing what a stop string may still cut off nor half a
    character: the last (longest stop − 1) characters and trailing U+FFFD are held back until the
    next token, and the final text comes from the finished result."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def delta(self, token_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")
        safe = len(text) - self.holdback
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent : safe], safe
        return out

    def final(self, text: str) -> str:
        out, self.sent = text[self.sent :], len(text)
        return out


async def stream_batch(
    run: BatchRun, requests: Sequence[GenerationRequest], tokenizer: PreTrainedTokenizerBase
) -> AsyncIterator[list[Any]]:
    """Run `run(requests, listeners)` in a thread; yield lists with, per request, a `StreamEvent`
    (merged since the last yield), None (nothing new) or `Done` once its last event went out."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()
    listeners = [_listener(loop, queue, i, TextStream(tokenizer, r.stop), tokenizer) for i, r in enumerate(requests)]
    engine = loop.run_in_executor(None, run, requests, listeners)
    finished = [False] * len(requests)
    while not all(finished):
        events = await _next_events(queue, engine, len(requests))
        item: list[Any] = []
        for i, event in enumerate(events):
            item.append(Done if finished[i] else event)
            finished[i] = finished[i] or (event is not None and event.result is not None)
        yield item
    await engine  # surfaces an error raised after the last row finished
    yield [Done] * len(requests)


def _listener(
    loop: asyncio.AbstractEventLoop,
    queue: asyncio.Queue[tuple[int, StreamEvent]],
    index: int,
    text: TextStream,
    tokenizer: PreTrainedTokenizerBase,
) -> TokenListener:
    def on_token(state: SequenceState, token: int) -> None:
        # Runs in the engine's thread: build the event here, hand it to the loop thread-safely.
        loop.call_soon_threadsafe(queue.put_nowait, (index, token_event(state, token, text, tokenizer)))

    return on_token


def token_event(state: SequenceState, token: int, text: TextStream, tokenizer: PreTrainedTokenizerBase) -> StreamEvent:
    """The event for a token just appended: the new text, and the result once the row finished."""
    if state.finished:
        result = state.result(tokenizer)
        return StreamEvent(text=text.final(result.text), token_ids=[token], result=result)
    return StreamEvent(text=text.delta(state.token_ids), token_ids=[token])


async def _next_events(
    queue: asyncio.Queue[tuple[int, StreamEvent]], engine: asyncio.Future, count: int
) -> list[StreamEvent | None]:
    """Wait for at least one event (or the engine's end), then take everything queued, in order."""
    arrived: list[tuple[int, StreamEvent]] = []
    if queue.empty():
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, engine}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            arrived.append(getter.result())
        else:
            getter.cancel()
            if engine.exception() is not None:
                raise engine.exception()
            if queue.empty():
                raise RuntimeError("the engine returned before every request had finished")
    while not queue.empty():
        arrived.append(queue.get_nowait())
    merged: list[StreamEvent | None] = [None] * count
    for index, event in arrived:
        merged[index] = event if merged[index] is None else merged[index].merge(event)
    return merged


class EngineQueue:
    """Dynamic batching for one blocking engine: requests wait here while the engine runs, and
    when it is free it takes everything waiting (up to `max_batch`), after waiting `wait_s` for
    company when it was idle.

    Ray Serve's `@serve.batch` was measured first: it forms the next batch while the current one
    runs, from requests arriving within its short wait window, so behind an engine busy for
    seconds per batch eight queued requests ran as batches of 2, 2, 1 and 3. Taking the whole
    queue when the engine frees up is what lets load turn into batch size.
    """

    def __init__(self, run: BatchRun, tokenizer: PreTrainedTokenizerBase, max_batch: int, wait_s: float):
        self.run, self.tokenizer, self.max_batch, self.wait_s = run, tokenizer, max_batch, wait_s
        self.waiting: list[tuple[GenerationRequest, asyncio.Queue[Any]]] = []
        self.arrived = asyncio.Event()
        self.worker: asyncio.Task | None = None
        self.batch_sizes: list[int] = []  # every batch run, for tests and diagnostics

    async def submit(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """The request's events, as its batch produces them."""
        if self.worker is None or self.worker.done():
            self.worker = asyncio.get_running_loop().create_task(self._serve())
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.waiting.append((request, inbox))
        self.arrived.set()
        while True:
            item = await inbox.get()
            if item is Done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def _serve(self) -> None:
        while True:
            await self.arrived.wait()
            if len(self.waiting) < self.max_batch:
                await asyncio.sleep(self.wait_s)  # an idle engine waits briefly for company
            batch, self.waiting = self.waiting[: self.max_batch], self.waiting[self.max_batch :]
            if not self.waiting:
                self.arrived.clear()
            if batch:
                await self._run_batch(batch)

    async def _run_batch(self, batch: list[tuple[GenerationRequest, asyncio.Queue[Any]]]) -> None:
        self.batch_sizes.append(len(batch))
        inboxes = [inbox for _, inbox in batch]
        try:
            async for item in stream_batch(self.run, [r for r, _ in batch], self.tokenizer):
                for inbox, x in zip(inboxes, item, strict=True):
                    if isinstance(x, StreamEvent):
                        inbox.put_nowait(x)
                        if x.result is not None:
                            inbox.put_nowait(Done)
        except Exception as exc:  # the engine failed: every request of the batch hears it
            for inbox in inboxes:
                inbox.put_nowait(exc)
