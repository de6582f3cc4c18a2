"""A backend replica's step loop, served: the `Scheduler` runs in a thread of its own, and each
request is an async stream of `StreamEvent`s, fed from that thread as its tokens are produced.

Everything that touches the scheduler happens on its thread: submissions and cancellations are
posted to it and applied between steps. A client that goes away (its stream is closed) frees its
row at the next step. Beyond `max_batch` running and `max_queued` waiting requests a new one is
refused at once with `Overloaded` (a 429 with Retry-After), never left to hang. A request that
fails inside the loop hears its own error; the others keep running. Nothing here imports Ray,
so the same code is tested in-process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from .errors import Overloaded
from .generation import GenerationRequest, SequenceState
from .scheduler import Row, Scheduler
from .streaming import StreamEvent, TextStream, token_event

log = logging.getLogger("specroute.serving")
RECENT = 64  # finished requests the Retry-After estimate looks back on


@dataclass
class _Ticket:
    """A request's link to its row, set on the loop thread once submitted."""

    row: Row | None = None
    ended: bool = False


class ServingLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        max_queued: int | None = None,
        observer: Callable[[Scheduler], None] | None = None,
    ):
        """`observer` is called on the loop's thread after every step (metrics: e.g.
        `backends.loop_metrics.LoopRecorder.observe`, which throttles its own export)."""
        self.scheduler = scheduler
        self.observer = observer
        self.tokenizer = scheduler.tokenizer
        settings = scheduler.settings
        self.capacity = settings.max_batch + (settings.max_queued if max_queued is None else max_queued)
        self.outstanding = 0  # requests submitted and not yet ended (the event loop's count)
        self.posts: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.closed = False
        self.durations: deque[float] = deque(maxlen=RECENT)

    async def stream(self, request: GenerationRequest, drafter: str | None = None) -> AsyncIterator[StreamEvent]:
        """The request's events as the loop produces them; the last carries the result."""
        ids = self.scheduler.check(request, drafter)  # a RequestError here is the caller's to fix
        if self.outstanding >= self.capacity:
            raise Overloaded(
                f"this backend is full ({self.outstanding} requests running or waiting): retry later",
                self.retry_after_s(),
            )
        self.outstanding += 1
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()
        ticket = _Ticket()
        text = TextStream(self.tokenizer, request.stop)

        def listener(state: SequenceState, token: int) -> None:  # on the loop's thread
            loop.call_soon_threadsafe(inbox.put_nowait, token_event(state, token, text, self.tokenizer))

        def fail(exc: BaseException) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, exc)

        def submit() -> None:
            try:
                ticket.row = self.scheduler.submit(request, listener, drafter, fail, prompt_ids=ids)
            except Exception as exc:  # the caller hears why instead of waiting forever
                fail(exc)

        self._post(submit)
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.result is not None:
                    ticket.ended = True
                    self.durations.append(time.perf_counter() - started)
                    return
        finally:
            self.outstanding -= 1
            if not ticket.ended and not self.closed:  # the client left (or the request failed): free its row
                self._post(lambda: ticket.row is not None and self.scheduler.cancel(ticket.row))

    def retry_after_s(self) -> int:
        """When a slot is likely to free: a recent request's duration over the rows running."""
        if not self.durations:
            return 1
        mean = sum(self.durations) / len(self.durations)
        return max(1, math.ceil(mean / self.scheduler.settings.max_batch))

    def _post(self, action: Callable[[], None]) -> None:
        if self.closed:
            raise RuntimeError("the step loop is closed")
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, name="step-loop", daemon=True)
            self.thread.start()
        self.posts.put(action)
        self.wake.set()

    def close(self) -> None:
        """Stop the loop's thread once its step is done, then free the engine's memory (a llama.cpp
        context): freed under a step still finishing — a row's release after its last token was
        streamed — the engine would be used after it is gone. Requests still held fail."""
        self.closed = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join()
        if not self.scheduler.idle:
            self.scheduler.abort(RuntimeError("the backend closed its step loop"))
        self.scheduler.close()

    def _run(self) -> None:
        while not self.closed:
            self.wake.clear()
            self._apply_posts()
            if self.closed:
                return
            if self.scheduler.idle:
                self.wake.wait()
                continue
            try:
                self.scheduler.step()
            except Exception as exc:  # a bug in the loop itself: fail what it holds, keep serving
                log.exception("step failed")
                self.scheduler.abort(exc)
            self._observe()

    def _observe(self) -> None:
        if self.observer is None:
            return
        try:
            self.observer(self.scheduler)
        except Exception:
            log.exception("the step observer failed")

    def _apply_posts(self) -> None:
        while True:
            try:
                action = self.posts.get_nowait()
            except queue.Empty:
                return
            try:
                action()
            except Exception:
                log.exception("a submission or cancellation failed")
