"""The service's metrics in the Prometheus text format, for its own GET /metrics (as vLLM serves
them), and — with `ray_export` — through `ray.serve.metrics` too, under the names Ray's export port
has always carried (Ray refuses ':' in names and prefixes `ray_`).

`ServiceMetrics` is the router's `Metrics` (router.core): it counts what the router sees, and
`render` adds each backend's step loop from the `LoopSnapshot`s a scrape gathered (a backend whose
replica did not answer is left out, not reported as zeros). One name per thing: vLLM's where vLLM
has the same quantity, specroute's own otherwise.

Router (labels; Ray export name):
- `vllm:time_to_first_token_seconds` histogram {backend}; specroute_time_to_first_token_seconds
- `vllm:request_time_per_output_token_seconds` histogram {backend}: each request's mean time per
  output token after the first (vLLM's per-request TPOT); specroute_time_per_output_token_seconds
- `vllm:spec_decode_num_drafts_total` {drafter}: speculative steps that verified drafted tokens
- `vllm:spec_decode_num_draft_tokens_total` {drafter}: drafted tokens verified
- `vllm:spec_decode_num_accepted_tokens_total` {drafter}
- `vllm:spec_decode_num_accepted_tokens_per_pos_total` {drafter, position}
  (Ray: the same four as specroute_spec_decode_*)
- `specroute_requests_total` {backend, stage}: requests routed
- `specroute_retries_total` {backend}: attempts that failed on this backend and were resumed
- `specroute_in_flight` gauge {backend}: requests the router has in flight
Step loops, from snapshots (labels {backend}; Ray export: backends.loop_metrics):
- `vllm:num_requests_running`, `vllm:num_requests_waiting` (the loop's queue length),
  `vllm:kv_cache_usage_perc` (0..1) gauges
- `specroute_batch_size_per_step` histogram: sequences in each step
- `specroute_generated_tokens_per_step` histogram: tokens each step generated
Counters and histograms also carry prometheus_client's `_created` series.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from backends.generation import GenerationResult
from backends.loop_metrics import HistogramSnapshot, LoopSnapshot

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60]
Kind = Literal["counter", "gauge", "histogram"]
_LOCAL = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


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
        b, d = ("backend",), ("drafter",)
        family = self._family
        self.requests = family("counter", "specroute_requests", None, "Requests routed", ("backend", "stage"))
        self.retries = family("counter", "specroute_retries", None, "Failed attempts, resumed", b)
        self.inflight = family("gauge", "specroute_in_flight", None, "Requests in flight per backend", b)
        self.ttft = family(
            "histogram", "vllm:time_to_first_token_seconds", "specroute_time_to_first_token_seconds", "TTFT", b
        )
        self.tpot = family(
            "histogram",
            "vllm:request_time_per_output_token_seconds",
            "specroute_time_per_output_token_seconds",
            "Each request's mean time per output token after the first",
            b,
        )
        spec = "specroute_spec_decode_num_"
        self.drafts = family("counter", "vllm:spec_decode_num_drafts", spec + "drafts", "Speculative steps", d)
        self.draft_tokens = family(
            "counter", "vllm:spec_decode_num_draft_tokens", spec + "draft_tokens", "Drafted tokens verified", d
        )
        self.accepted = family(
            "counter", "vllm:spec_decode_num_accepted_tokens", spec + "accepted_tokens", "Drafted tokens accepted", d
        )
        self.per_position = family(
            "counter",
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            spec + "accepted_tokens_per_pos",
            "Accepted drafted tokens by position",
            ("drafter", "position"),
        )

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

    def _family(
        self, kind: Kind, name: str, ray_name: str | None, documentation: str, labels: tuple[str, ...]
    ) -> _Family:
        """`ray_name`: the name on Ray's export port, where it differs."""
        buckets = {"buckets": LATENCY_BUCKETS} if kind == "histogram" else {}
        local = _LOCAL[kind](name, documentation, labels, registry=self.registry, **buckets)
        ray = _ray_metric(kind, ray_name or name, documentation, labels) if self.ray_export else None
        return _Family(local, ray)


def _ray_metric(kind: Kind, name: str, documentation: str, labels: tuple[str, ...]) -> Any:
    from ray.serve import metrics  # only the Router replica exports to Ray: tests and tools need no Ray

    if kind == "histogram":
        return metrics.Histogram(name, documentation, LATENCY_BUCKETS, labels)
    return {"counter": metrics.Counter, "gauge": metrics.Gauge}[kind](name, documentation, labels)


class LoopFamilies(Collector):
    """The step loops of the backends that answered a scrape, as metric families labelled by backend."""

    GAUGES = (
        ("vllm:num_requests_running", "Requests in the step loop's batch", "running"),
        ("vllm:num_requests_waiting", "Requests queued for a row of the step loop", "waiting"),
        ("vllm:kv_cache_usage_perc", "Share of the KV cache held (0..1)", "kv_cache_usage"),
    )
    HISTOGRAMS = (
        ("specroute_batch_size_per_step", "Sequences in each step of the loop", "batch_size"),
        ("specroute_generated_tokens_per_step", "Tokens each step of the loop generated", "tokens"),
    )

    def __init__(self, snapshots: Sequence[LoopSnapshot]):
        self.snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        if not self.snapshots:  # no backend answered: no families rather than empty ones
            return
        for name, documentation, field in self.GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=["backend"])
            for snapshot in self.snapshots:
                gauge.add_metric([snapshot.backend], getattr(snapshot, field))
            yield gauge
        for name, documentation, field in self.HISTOGRAMS:
            histogram = HistogramMetricFamily(name, documentation, labels=["backend"])
            for snapshot in self.snapshots:
                h: HistogramSnapshot = getattr(snapshot, field)
                buckets = [(floatToGoString(b), c) for b, c in zip(h.buckets, h.cumulative, strict=True)]
                histogram.add_metric([snapshot.backend], [*buckets, ("+Inf", h.count)], sum_value=h.sum)
            yield histogram
