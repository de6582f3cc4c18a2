"""The service's metrics in the Prometheus text format, for its own GET /metrics (as vLLM serves
them), and — with `ray_export` — through `ray.serve.metrics` too, under the names Ray's export port
has always carried (Ray refuses ':' in names and prefixes `ray_`).

`ServiceMetrics` is the router's `Metrics` (router.core): it counts what the router sees, and
`render` adds each backend's step loop from the `LoopSnapshot`s a scrape gathered (a backend whose
replica did not answer is left out, not reported as zeros). One name per thing: vLLM's where vLLM
has the same quantity, specroute's own otherwise.

`ROUTER_METRICS` and `LOOP_METRICS` below are the one list of every family (name, type, labels,
help, Ray export name): the registry is built from them and docs/reference/metrics.md is generated
from them (`python -m router.docs_gen`). Counters are exposed with prometheus_client's `_total`
suffix, and counters and histograms also carry its `_created` series.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from backends.generation import GenerationResult
from backends.loop_metrics import HistogramSnapshot, LoopSnapshot

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60]
Kind = Literal["counter", "gauge", "histogram"]
_LOCAL = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
_SPEC = "specroute_spec_decode_num_"


@dataclass(frozen=True)
class MetricSpec:
    """One metric family as declared: `ray_name` is its name on Ray's export port where that
    differs; `field` is the `LoopSnapshot` field a step-loop family reads."""

    kind: Kind
    name: str
    documentation: str
    labels: tuple[str, ...]
    ray_name: str | None = None
    field: str | None = None

    @property
    def exposed(self) -> str:
        """The name a scrape shows (prometheus_client adds `_total` to a counter)."""
        return self.name + "_total" if self.kind == "counter" else self.name


REQUESTS = MetricSpec(
    "counter", "specroute_requests", "Requests routed, by backend and policy stage", ("backend", "stage")
)
RETRIES = MetricSpec(
    "counter", "specroute_retries", "Attempts that failed on this backend and were resumed on another", ("backend",)
)
IN_FLIGHT = MetricSpec("gauge", "specroute_in_flight", "Requests the router has in flight per backend", ("backend",))
TTFT = MetricSpec(
    "histogram",
    "vllm:time_to_first_token_seconds",
    "Time to first token, seconds",
    ("backend",),
    "specroute_time_to_first_token_seconds",
)
TPOT = MetricSpec(
    "histogram",
    "vllm:request_time_per_output_token_seconds",
    "Each request's mean time per output token after the first, seconds (vLLM's per-request TPOT)",
    ("backend",),
    "specroute_time_per_output_token_seconds",
)
DRAFTS = MetricSpec(
    "counter",
    "vllm:spec_decode_num_drafts",
    "Speculative steps that verified drafted tokens",
    ("drafter",),
    _SPEC + "drafts",
)
DRAFT_TOKENS = MetricSpec(
    "counter", "vllm:spec_decode_num_draft_tokens", "Drafted tokens verified", ("drafter",), _SPEC + "draft_tokens"
)
ACCEPTED = MetricSpec(
    "counter",
    "vllm:spec_decode_num_accepted_tokens",
    "Drafted tokens accepted",
    ("drafter",),
    _SPEC + "accepted_tokens",
)
PER_POSITION = MetricSpec(
    "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "Accepted drafted tokens by position in the draft (0: the first drafted token)",
    ("drafter", "position"),
    _SPEC + "accepted_tokens_per_pos",
)
ROUTER_METRICS = (REQUESTS, RETRIES, IN_FLIGHT, TTFT, TPOT, DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POSITION)
# Each backend's step loop, from the snapshots a scrape gathered (Ray export: backends.loop_metrics).
LOOP_METRICS = (
    MetricSpec(
        "gauge", "vllm:num_requests_running", "Requests in the step loop's batch", ("backend",), field="running"
    ),
    MetricSpec(
        "gauge",
        "vllm:num_requests_waiting",
        "Requests queued for a row of the step loop",
        ("backend",),
        field="waiting",
    ),
    MetricSpec(
        "gauge", "vllm:kv_cache_usage_perc", "Share of the KV cache held (0..1)", ("backend",), field="kv_cache_usage"
    ),
    MetricSpec(
        "counter",
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
        ("backend",),
        field="prefix_cache_queries",
    ),
    MetricSpec(
        "counter",
        "vllm:prefix_cache_hits",
        "Prompt tokens found in the prefix cache (not prefilled)",
        ("backend",),
        field="prefix_cache_hits",
    ),
    MetricSpec(
        "counter",
        "vllm:num_preemptions",
        "Rows preempted for KV blocks (they wait, then prefill their tokens again and go on)",
        ("backend",),
        field="preemptions",
    ),
    MetricSpec(
        "gauge",
        "specroute_prefix_cache_hit_rate",
        "Share of looked-up prompt tokens found in the prefix cache since the replica started (0..1)",
        ("backend",),
        field="prefix_cache_hit_rate",
    ),
    MetricSpec(
        "histogram",
        "specroute_batch_size_per_step",
        "Sequences in each step of the loop",
        ("backend",),
        field="batch_size",
    ),
    MetricSpec(
        "histogram",
        "specroute_generated_tokens_per_step",
        "Tokens each step of the loop generated",
        ("backend",),
        field="tokens",
    ),
)


class _Family:
    """One metric, recorded into the service's registry and, with Ray export, into Ray's."""

    def __init__(self, local: Any, ray: Any | None):
        self.local, self.ray = local, ray

    def inc(self, amount: float, **labels: str) -> None:
        self.local.labels(**labels).inc(amount)  # a zero still creates the series, as vLLM shows it
        if self.ray is not None and amount > 0:  # Ray's counters refuse a zero increment
            self.ray.inc(amount, tags=labels)

    def set(self, value: float, **labels: str) -> None:
        self.local.labels(**labels).set(value)
        if self.ray is not None:
            self.ray.set(value, tags=labels)

    def observe(self, value: float, **labels: str) -> None:
        self.local.labels(**labels).observe(value)
        if self.ray is not None:
            self.ray.observe(value, tags=labels)


class ServiceMetrics:
    """The router's `Metrics`, kept in a registry of its own; `render` is the /metrics body."""

    def __init__(self, ray_export: bool = True):
        self.registry = CollectorRegistry()
        self.ray_export = ray_export
        self.requests, self.retries = self._family(REQUESTS), self._family(RETRIES)
        self.inflight = self._family(IN_FLIGHT)
        self.ttft, self.tpot = self._family(TTFT), self._family(TPOT)
        self.drafts, self.draft_tokens = self._family(DRAFTS), self._family(DRAFT_TOKENS)
        self.accepted, self.per_position = self._family(ACCEPTED), self._family(PER_POSITION)

    def routed(self, backend: str, stage: str) -> None:
        self.requests.inc(1, backend=backend, stage=stage)

    def in_flight(self, backend: str, count: int) -> None:
        self.inflight.set(count, backend=backend)

    def retried(self, backend: str) -> None:
        self.retries.inc(1, backend=backend)

    def finished(self, backend: str, result: GenerationResult) -> None:
        self.ttft.observe(result.ttft_s, backend=backend)
        if result.completion_tokens > 1:  # one token has no time per output token
            self.tpot.observe(result.tpot_s, backend=backend)
        stats = result.speculation
        if stats is None or not stats.drafts:
            return
        self.drafts.inc(stats.drafts, drafter=stats.drafter)
        self.draft_tokens.inc(stats.draft_tokens, drafter=stats.drafter)
        self.accepted.inc(stats.accepted_tokens, drafter=stats.drafter)
        for position, count in enumerate(stats.accepted_per_position):
            self.per_position.inc(count, drafter=stats.drafter, position=str(position))

    def render(self, snapshots: Sequence[LoopSnapshot]) -> tuple[bytes, str]:
        """The text exposition and its content type: the router's metrics, then each step loop's."""
        return generate_latest(self.registry) + generate_latest(LoopFamilies(snapshots)), CONTENT_TYPE_LATEST

    def _family(self, spec: MetricSpec) -> _Family:
        buckets = {"buckets": LATENCY_BUCKETS} if spec.kind == "histogram" else {}
        local = _LOCAL[spec.kind](spec.name, spec.documentation, spec.labels, registry=self.registry, **buckets)
        if not self.ray_export:
            return _Family(local, None)
        return _Family(local, _ray_metric(spec.kind, spec.ray_name or spec.name, spec.documentation, spec.labels))


def _ray_metric(kind: Kind, name: str, documentation: str, labels: tuple[str, ...]) -> Any:
    from ray.serve import metrics  # only the Router replica exports to Ray: tests and tools need no Ray

    if kind == "histogram":
        return metrics.Histogram(name, documentation, LATENCY_BUCKETS, labels)
    return {"counter": metrics.Counter, "gauge": metrics.Gauge}[kind](name, documentation, labels)


class LoopFamilies(Collector):
    """The step loops of the backends that answered a scrape, as metric families labelled by backend."""

    def __init__(self, snapshots: Sequence[LoopSnapshot]):
        self.snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        if not self.snapshots:  # no backend answered: no families rather than empty ones
            return
        for spec in LOOP_METRICS:
            if spec.kind == "gauge":
                yield self._gauge(spec)
            elif spec.kind == "counter":
                yield self._counter(spec)
            else:
                yield self._histogram(spec)

    def _counter(self, spec: MetricSpec) -> Metric:
        counter = CounterMetricFamily(spec.name, spec.documentation, labels=list(spec.labels))
        for snapshot in self.snapshots:
            counter.add_metric([snapshot.backend], getattr(snapshot, str(spec.field)))
        return counter

    def _gauge(self, spec: MetricSpec) -> Metric:
        gauge = GaugeMetricFamily(spec.name, spec.documentation, labels=list(spec.labels))
        for snapshot in self.snapshots:
            gauge.add_metric([snapshot.backend], getattr(snapshot, str(spec.field)))
        return gauge

    def _histogram(self, spec: MetricSpec) -> Metric:
        histogram = HistogramMetricFamily(spec.name, spec.documentation, labels=list(spec.labels))
        for snapshot in self.snapshots:
            h: HistogramSnapshot = getattr(snapshot, str(spec.field))
            buckets = [(floatToGoString(b), c) for b, c in zip(h.buckets, h.cumulative, strict=True)]
            histogram.add_metric([snapshot.backend], [*buckets, ("+Inf", h.count)], sum_value=h.sum)
        return histogram
