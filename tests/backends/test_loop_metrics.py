"""The step loop's recorder: every step lands in the batch-size and tokens-per-step histograms —
rows that finish in a step count in it, rows cancelled before it do not — the served loop reports
every step, and the Ray export is throttled but never left stale when the loop falls idle."""

import asyncio
import time
from collections import deque
from types import SimpleNamespace

import pytest

from backends import loop_metrics
from backends.generation import GenerationRequest
from backends.kv import PrefixStats
from backends.loop_metrics import LoopRecorder, LoopSnapshot
from backends.scheduler import LoopSettings, Scheduler, StepRecord
from backends.serving import ServingLoop
from backends.speculative.drafters import ModelDrafter


def _request(tokens: int, text: str = "Hello there") -> GenerationRequest:
    return GenerationRequest(prompt=text, max_tokens=tokens, ignore_eos=True)


def _step(scheduler: Scheduler, recorder: LoopRecorder) -> LoopSnapshot:
    scheduler.step()
    recorder.observe(scheduler)
    return recorder.snapshot()


def test_a_row_counts_in_the_step_it_finishes_in(tiny_target):
    scheduler = Scheduler(tiny_target, LoopSettings())
    recorder = LoopRecorder("plain", ray_export=False)
    for tokens in (4, 6, 8):
        scheduler.submit(_request(tokens))
    first = _step(scheduler, recorder)
    assert (first.running, first.waiting) == (3, 0)
    assert first.kv_cache_usage == scheduler.cache.usage > 0
    while not scheduler.idle:
        last = _step(scheduler, recorder)
    # Step 1 prefills (a first token) and decodes (a second); then one token a step: the 4-token
    # request ends in step 3, the 6-token one in step 5, the 8-token one in step 7.
    assert last.steps == scheduler.steps == 7
    assert last.batch_size.cumulative[:4] == [2, 4, 7, 7] and last.batch_size.sum == 3 * 3 + 2 * 2 + 1 * 2
    assert last.tokens.cumulative[:4] == [2, 4, 6, 7] and last.tokens.sum == 4 + 6 + 8
    assert (last.running, last.waiting, last.kv_cache_usage) == (0, 0, 0.0)


def test_prefix_cache_lookups_are_counted_in_prompt_tokens(tiny_target):
    scheduler = Scheduler(tiny_target, LoopSettings())
    recorder = LoopRecorder("plain", ray_export=False)
    text = "A prompt long enough to fill at least two blocks of sixteen tokens each, and then some more words"
    prompt_tokens = len(tiny_target.tokenizer(text).input_ids)
    first = scheduler.submit(_request(2, text))
    while not first.done:
        snapshot = _step(scheduler, recorder)
    assert (snapshot.prefix_cache_queries, snapshot.prefix_cache_hits) == (prompt_tokens, 0)
    second = scheduler.submit(_request(2, text))
    snapshot = _step(scheduler, recorder)
    hits = second.state.cached_tokens
    assert hits == (prompt_tokens - 1) // 16 * 16 > 0
    assert (snapshot.prefix_cache_queries, snapshot.prefix_cache_hits) == (2 * prompt_tokens, hits)
    assert snapshot.prefix_cache_hit_rate == hits / (2 * prompt_tokens)


def test_preemptions_are_counted(tiny_target):
    scheduler = Scheduler(tiny_target, LoopSettings(max_batch=8, kv_cache_tokens=64))
    recorder = LoopRecorder("plain", ray_export=False)
    rows = [scheduler.submit(_request(40, text)) for text in ("Hello there", "Good morning")]
    while not all(r.done for r in rows):
        snapshot = _step(scheduler, recorder)
    assert snapshot.preemptions == scheduler.preemptions > 0


def test_a_row_cancelled_before_a_step_does_not_count_in_it(tiny_target):
    scheduler = Scheduler(tiny_target, LoopSettings(max_batch=1))
    recorder = LoopRecorder("plain", ray_export=False)
    first, _ = scheduler.submit(_request(20)), scheduler.submit(_request(20))
    snapshot = _step(scheduler, recorder)
    assert (snapshot.running, snapshot.waiting) == (1, 1)
    scheduler.cancel(first)
    snapshot = _step(scheduler, recorder)  # the second request takes the row: prefill + one decode
    assert snapshot.batch_size.cumulative[0] == 2 and snapshot.batch_size.sum == 2
    assert snapshot.tokens.sum == 2 + 2 and (snapshot.running, snapshot.waiting) == (1, 0)


def test_the_served_loop_reports_every_step_and_every_token(tiny_target):
    exact = ModelDrafter(tiny_target.model, tiny_target.model.config.vocab_size)  # greedy drafts all accepted
    scheduler = Scheduler(tiny_target, LoopSettings(), [exact], k=2)
    recorder = LoopRecorder("speculative", ray_export=False)
    loop = ServingLoop(scheduler, observer=recorder.observe)

    async def served(tokens: int):
        return [e async for e in loop.stream(_request(tokens))][-1].result

    async def go():
        return await asyncio.gather(*(served(tokens) for tokens in (8, 12, 16)))

    results = asyncio.run(go())
    snapshot = _wait_for(recorder, lambda s: s.steps == scheduler.steps)
    assert all(r.speculation.accepted_tokens for r in results)  # steps emitted several tokens a row
    assert snapshot.tokens.sum == sum(r.completion_tokens for r in results) == 8 + 12 + 16
    assert (snapshot.running, snapshot.waiting) == (0, 0)


def _wait_for(recorder: LoopRecorder, condition, timeout_s: float = 10.0) -> LoopSnapshot:
    """The loop observes its last step just after the last token went out: wait for it."""
    deadline = time.monotonic() + timeout_s
    while not condition(snapshot := recorder.snapshot()):
        assert time.monotonic() < deadline, f"the recorder never got there: {snapshot}"
        time.sleep(0.01)
    return snapshot


class _Exports:
    def __init__(self):
        self.calls: list[tuple[int, list[int]]] = []

    def export(self, snapshot: LoopSnapshot, batch_sizes: list[int]) -> None:
        self.calls.append((snapshot.running, list(batch_sizes)))


def _fake_loop(rows: int, idle: bool = False, ran: int | None = None) -> SimpleNamespace:
    """What the recorder reads of a scheduler: `rows` running after a step that ran `ran` (default
    `rows`) sequences and appended a token to each."""
    ran = rows if ran is None else ran
    running = [SimpleNamespace(key=k) for k in range(rows)]
    cache = SimpleNamespace(usage=0.25, prefix_stats=PrefixStats())
    return SimpleNamespace(
        running=running, waiting=deque(), cache=cache, idle=idle, last_step=StepRecord(ran, ran), preemptions=0
    )


def test_the_ray_export_is_throttled_but_follows_the_loop_into_idle(monkeypatch):
    recorder = LoopRecorder("plain", ray_export=False)
    recorder.exporter = exports = _Exports()
    clock = iter([100.0, 100.1, 100.2, 100.0 + loop_metrics.OBSERVE_S, 100.7])
    monkeypatch.setattr(loop_metrics.time, "monotonic", lambda: next(clock))
    for rows in (1, 2, 3, 4):
        recorder.observe(_fake_loop(rows))
    recorder.observe(_fake_loop(0, idle=True, ran=4))
    assert exports.calls == [(1, [1]), (4, [2, 3, 4]), (0, [4])]  # the last step's 4 rows all finished in it


def test_the_ray_export_takes_the_recorders_values():
    recorder = LoopRecorder("quantized", ray_export=True)  # Ray records without a cluster: this checks the calls
    recorder.observe(_fake_loop(3))
    recorder.observe(_fake_loop(0, idle=True, ran=3))
    assert recorder.snapshot().steps == 2 and recorder.unexported == []


@pytest.mark.parametrize("value, bucket", [(1, 0), (2, 1), (3, 2), (512, 9), (513, 10)])
def test_a_step_lands_in_the_first_bucket_not_below_it(value, bucket):
    recorder = LoopRecorder("plain", ray_export=False)
    recorder.observe(_fake_loop(value))
    histogram = recorder.snapshot().batch_size
    cumulative = [*histogram.cumulative, histogram.count]  # the last is +Inf
    assert cumulative == [0] * bucket + [1] * (len(cumulative) - bucket)
