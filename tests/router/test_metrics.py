"""The service's /metrics text: what the router counted under vLLM's and specroute's names, each
reachable backend's step loop labelled by backend, nothing invented for a backend that did not
answer, and a Ray export that never trips over Ray's refusal of zero increments."""

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from backends.generation import GenerationResult
from backends.loop_metrics import HistogramSnapshot, LoopSnapshot
from backends.speculative.stats import SpeculationStats
from router.metrics import ServiceMetrics

Samples = dict[tuple[str, frozenset], float]


def _result(tokens: int, ttft_s: float, tpot_s: float, stats: SpeculationStats | None = None) -> GenerationResult:
    return GenerationResult(
        text="x" * tokens,
        token_ids=[1] * tokens,
        finish_reason="length",
        prompt_tokens=5,
        completion_tokens=tokens,
        ttft_s=ttft_s,
        tpot_s=tpot_s,
        seed=0,
        speculation=stats,
    )


def _stats(drafts: int, draft_tokens: int, accepted: int, per_position: list[int]) -> SpeculationStats:
    return SpeculationStats(
        drafter="ngram",
        k_mode="auto",
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        accepted_per_position=per_position,
    )


def _snapshot(backend: str) -> LoopSnapshot:
    def histogram(cumulative: list[int], total: float) -> HistogramSnapshot:
        return HistogramSnapshot(buckets=[1.0, 2.0, 4.0], cumulative=cumulative, sum=total, count=cumulative[-1] + 1)

    return LoopSnapshot(
        backend=backend,
        running=3,
        waiting=2,
        kv_cache_usage=0.375,
        prefix_cache_queries=400,
        prefix_cache_hits=300,
        preemptions=2,
        batch_size=histogram([1, 2, 4], 17.0),  # steps of 1, 2, 3, 4 and 7 sequences
        tokens=histogram([0, 1, 3], 29.0),
    )


def _parse(text: bytes) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and every family's type by name."""
    families = list(text_string_to_metric_families(text.decode()))
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    return samples, {f.name: f.type for f in families}


def _served() -> ServiceMetrics:
    metrics = ServiceMetrics(ray_export=False)
    metrics.routed("speculative", "speculate")
    metrics.routed("speculative", "speculate")
    metrics.routed("plain", "batch")
    metrics.retried("plain")
    metrics.in_flight("speculative", 4)
    metrics.in_flight("speculative", 3)  # a gauge: the latest count stands
    metrics.finished("speculative", _result(8, 0.03, 0.012, _stats(3, 7, 4, [3, 1, 0])))
    metrics.finished("speculative", _result(6, 0.25, 0.05, _stats(2, 4, 2, [2])))
    metrics.finished("plain", _result(1, 0.07, 0.0))  # one token: no time per output token
    return metrics


def test_the_router_counts_under_vllm_and_specroute_names():
    body, content_type = _served().render([])
    samples, types = _parse(body)
    spec, ngram = frozenset({("backend", "speculative")}), frozenset({("drafter", "ngram")})
    assert content_type == CONTENT_TYPE_LATEST
    assert samples[("specroute_requests_total", frozenset({("backend", "speculative"), ("stage", "speculate")}))] == 2
    assert samples[("specroute_requests_total", frozenset({("backend", "plain"), ("stage", "batch")}))] == 1
    assert samples[("specroute_retries_total", frozenset({("backend", "plain")}))] == 1
    assert samples[("specroute_in_flight", spec)] == 3
    assert samples[("vllm:spec_decode_num_drafts_total", ngram)] == 5
    assert samples[("vllm:spec_decode_num_draft_tokens_total", ngram)] == 11
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", ngram)] == 6
    per_position = {
        position: samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", ngram | {("position", position)})]
        for position in ("0", "1", "2")
    }
    assert per_position == {"0": 5, "1": 1, "2": 0}
    assert types["vllm:spec_decode_num_drafts"] == types["specroute_requests"] == "counter"


def test_latency_histograms_count_each_request_once_per_backend():
    samples, types = _parse(_served().render([])[0])
    spec, plain = frozenset({("backend", "speculative")}), frozenset({("backend", "plain")})
    ttft, tpot = "vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds"
    assert types[ttft] == types[tpot] == "histogram"
    assert samples[(ttft + "_count", spec)] == 2 and samples[(ttft + "_sum", spec)] == 0.03 + 0.25
    assert samples[(ttft + "_bucket", spec | {("le", "0.04")})] == 1
    assert samples[(ttft + "_count", plain)] == 1
    assert samples[(tpot + "_count", spec)] == 2 and samples[(tpot + "_sum", spec)] == 0.012 + 0.05
    assert (tpot + "_count", plain) not in samples


def test_each_answering_backend_has_its_loop_labelled_and_a_silent_one_has_none():
    samples, types = _parse(_served().render([_snapshot("speculative"), _snapshot("quantized")])[0])
    for backend in ("speculative", "quantized"):
        label = frozenset({("backend", backend)})
        assert samples[("vllm:num_requests_running", label)] == 3
        assert samples[("vllm:num_requests_waiting", label)] == 2
        assert samples[("vllm:kv_cache_usage_perc", label)] == 0.375
        assert samples[("vllm:prefix_cache_queries_total", label)] == 400
        assert samples[("vllm:prefix_cache_hits_total", label)] == 300
        assert samples[("specroute_prefix_cache_hit_rate", label)] == 0.75
        assert samples[("vllm:num_preemptions_total", label)] == 2
        buckets = [
            samples[("specroute_batch_size_per_step_bucket", label | {("le", le)})] for le in ("1.0", "2.0", "4.0")
        ]
        assert buckets == [1, 2, 4] and samples[("specroute_batch_size_per_step_bucket", label | {("le", "+Inf")})] == 5
        assert samples[("specroute_batch_size_per_step_count", label)] == 5
        assert samples[("specroute_batch_size_per_step_sum", label)] == 17
        assert samples[("specroute_generated_tokens_per_step_sum", label)] == 29
    assert types["specroute_batch_size_per_step"] == types["specroute_generated_tokens_per_step"] == "histogram"
    assert types["vllm:prefix_cache_queries"] == types["vllm:prefix_cache_hits"] == "counter"
    loop_families = ("vllm:num_requests", "vllm:kv_cache", "specroute_batch_size", "specroute_generated_tokens")
    backends = {dict(labels)["backend"] for name, labels in samples if name.startswith(loop_families)}
    assert backends == {"speculative", "quantized"}  # plain did not answer: no zeros for it


def test_no_backend_answering_leaves_no_loop_families():
    _, types = _parse(_served().render([])[0])
    assert not [name for name in types if name.startswith(("vllm:num_requests", "vllm:kv_cache", "specroute_batch"))]


def test_ray_export_skips_the_zero_increments_ray_refuses():
    metrics = ServiceMetrics(ray_export=True)  # Ray records without a cluster, and checks each call
    metrics.finished("speculative", _result(4, 0.02, 0.01, _stats(2, 4, 0, [0, 0])))  # nothing accepted
    samples, _ = _parse(metrics.render([])[0])
    ngram = frozenset({("drafter", "ngram")})
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", ngram)] == 0
    assert samples[("vllm:spec_decode_num_drafts_total", ngram)] == 2
