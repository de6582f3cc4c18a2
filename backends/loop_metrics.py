"""A backend's step loop, measured: after every step `LoopRecorder.observe` reads the scheduler
(requests running and waiting, the KV cache's share held) and adds the step to two histograms —
sequences in the step (the batch size) and tokens it generated — and `snapshot` hands all of it over
as a `LoopSnapshot` (router.metrics renders snapshots on the service's GET /metrics).

`observe` runs on the loop's thread after every step, `snapshot` on the event loop's: a lock
guards what both touch, and `observe` reads only what the step already holds. With `ray_export`
the same state also goes to `ray.serve.metrics` (Ray's metrics export port) at most every
`OBSERVE_S` seconds, and at once when the loop falls idle so its gauges never keep a busy value.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate

from pydantic import BaseModel, Field, computed_field

from .kv import PrefixStats
from .scheduler import Scheduler

OBSERVE_S = 0.5
BATCH_BUCKETS = tuple(float(1 << i) for i in range(10))  # 1 … 512: LoopSettings.max_batch is at most 512
# A speculative row emits up to k + 1 ≤ 33 tokens a step, and a step holds up to 512 rows.
TOKEN_BUCKETS = tuple(float(1 << i) for i in range(15))  # 1 … 16384


class HistogramSnapshot(BaseModel):
    """A Prometheus histogram: `cumulative[i]` observations were ≤ `buckets[i]`, `count` in all
    (the +Inf bucket), `sum` their total."""

    buckets: list[float]
    cumulative: list[int]
    sum: float
    count: int


class LoopSnapshot(BaseModel):
    """One backend replica's step loop as it stands."""

    backend: str
    running: int = Field(ge=0, description="requests in the batch")
    waiting: int = Field(ge=0, description="requests queued for a row")
    kv_cache_usage: float = Field(ge=0, description="share of the KV cache held, 0..1 (vLLM's kv_cache_usage_perc)")
    prefix_cache_queries: int = Field(0, ge=0, description="prompt tokens looked up in the prefix cache so far")
    prefix_cache_hits: int = Field(0, ge=0, description="prompt tokens found in the prefix cache so far")
    preemptions: int = Field(0, ge=0, description="rows preempted for KV blocks so far (resumed later)")
    batch_size: HistogramSnapshot = Field(description="sequences in each step")
    tokens: HistogramSnapshot = Field(description="tokens each step generated (with accepted drafts)")

    @computed_field
    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits over queries since the replica started (0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @computed_field
    @property
    def steps(self) -> int:
        """Steps that ran sequences since the replica started."""
        return self.batch_size.count


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1  # Prometheus buckets are upper bounds, inclusive
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative = list(accumulate(self.counts))
        return HistogramSnapshot(
            buckets=list(self.buckets), cumulative=cumulative[:-1], sum=self.total, count=cumulative[-1]
        )


class LoopRecorder:
    """One replica's step loop, observed after every step (see the module docstring)."""

    def __init__(self, backend: str, ray_export: bool = True):
        self.backend = backend
        self.lock = threading.Lock()
        self.running = self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix = PrefixStats()
        self.preemptions = 0
        self.batch_size, self.tokens = _Histogram(BATCH_BUCKETS), _Histogram(TOKEN_BUCKETS)
        self.exporter = RayLoopExporter(backend) if ray_export else None
        self.unexported: list[int] = []  # batch sizes of the steps since the last export
        self.exported_at = -math.inf

    def observe(self, scheduler: Scheduler) -> None:
        """After a step, on the loop's thread."""
        batch, tokens = scheduler.last_step.rows, scheduler.last_step.tokens
        running, waiting, usage = len(scheduler.running), len(scheduler.waiting), scheduler.cache.usage
        prefix = PrefixStats(scheduler.cache.prefix_stats.queries, scheduler.cache.prefix_stats.hits)
        with self.lock:
            self.running, self.waiting, self.kv_cache_usage, self.prefix = running, waiting, usage, prefix
            self.preemptions = scheduler.preemptions
            if batch:  # a step whose every row was cancelled ran nothing
                self.batch_size.observe(batch)
                self.tokens.observe(tokens)
        if self.exporter is not None:
            self._export(self.exporter, batch, scheduler.idle)

    def snapshot(self) -> LoopSnapshot:
        with self.lock:
            return LoopSnapshot(
                backend=self.backend,
                running=self.running,
                waiting=self.waiting,
                kv_cache_usage=self.kv_cache_usage,
                prefix_cache_queries=self.prefix.queries,
                prefix_cache_hits=self.prefix.hits,
                preemptions=self.preemptions,
                batch_size=self.batch_size.snapshot(),
                tokens=self.tokens.snapshot(),
            )

    def _export(self, exporter: RayLoopExporter, batch: int, idle: bool) -> None:
        if batch:
            self.unexported.append(batch)
        now = time.monotonic()
        if now - self.exported_at < OBSERVE_S and not idle:
            return
        self.exported_at = now
        exporter.export(self.snapshot(), self.unexported)
        self.unexported = []


class RayLoopExporter:
    """The loop's state through `ray.serve.metrics`, under the names it has always had there."""

    def __init__(self, backend: str):
        from ray.serve.metrics import Gauge, Histogram  # only a replica exports to Ray: tests and tools need no Ray

        tags = ("backend",)
        self.tags = {"backend": backend}
        self.running = Gauge("specroute_num_requests_running", "Requests in the step loop's batch", tags)
        self.waiting = Gauge("specroute_num_requests_waiting", "Requests waiting for a row", tags)
        self.kv = Gauge("specroute_kv_cache_usage_perc", "Share of the KV cache held (0..1)", tags)
        self.batch_size = Histogram(
            "specroute_batch_size_per_step", "Sequences in each step of the loop", list(BATCH_BUCKETS), tags
        )

    def export(self, snapshot: LoopSnapshot, batch_sizes: list[int]) -> None:
        self.running.set(snapshot.running, tags=self.tags)
        self.waiting.set(snapshot.waiting, tags=self.tags)
        self.kv.set(snapshot.kv_cache_usage, tags=self.tags)
        for size in batch_sizes:  # Ray's histogram takes one observation at a time
            self.batch_size.observe(size, tags=self.tags)
