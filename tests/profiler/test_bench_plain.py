import pytest
from pydantic import ValidationError

from backends.engines.llamacpp import llama_unavailable
from backends.packing import packing_available
from profiler.bench_plain import BenchPlainConfig, render_report, run_bench_plain

pytestmark = pytest.mark.slow


def test_bench_plain_reports_a_side_by_side_ratio_and_bandwidth(loaded):
    report = run_bench_plain(
        BenchPlainConfig(
            max_tokens=4,
            batch_sizes=[1, 3],
            rounds=1,
            gguf_weights=["file", "Q8_0"],
            quality_prompts=1,
            quality_tokens=4,
        )
    )
    comparison = report.comparison
    assert comparison.identical_tokens
    assert comparison.ratio == pytest.approx(comparison.specroute_tokens_per_s / comparison.transformers_tokens_per_s)
    assert [p.batch_size for p in report.batches] == [1, 3]
    assert all(p.tokens_per_s > 0 and p.step_ms > 0 for p in report.batches)
    bandwidth = report.bandwidth
    assert bandwidth.weight_bytes == loaded.info.weight_bytes
    assert bandwidth.fraction == pytest.approx(bandwidth.achieved_bytes_per_s / bandwidth.copy_bytes_per_s)
    assert bandwidth.achieved_bytes_per_s == pytest.approx(bandwidth.weight_bytes / (bandwidth.decode_step_ms / 1e3))
    assert bandwidth.matvec_fraction == pytest.approx(bandwidth.achieved_bytes_per_s / bandwidth.matvec_bytes_per_s)
    text = render_report(report)
    assert "ratio" in text and "GB/s achieved" in text and "greedy tokens identical     yes" in text
    # The measured numbers, formatted, on their own lines.
    lines = text.splitlines()
    assert f"  specroute plain engine      {comparison.specroute_tokens_per_s:8.2f} tok/s" in lines
    assert f"  transformers generate       {comparison.transformers_tokens_per_s:8.2f} tok/s" in lines
    assert f"  ratio                       {comparison.ratio:8.3f}×" in lines
    base = report.batches[0].tokens_per_s
    for p in report.batches:
        row = [str(p.batch_size), f"{p.tokens_per_s:.1f}", f"{p.step_ms:.1f}", f"{p.tokens_per_s / base:.2f}×"]
        assert row in [line.split() for line in lines]
    assert f"= {bandwidth.achieved_bytes_per_s / 1e9:.2f} GB/s achieved" in text
    assert f"{bandwidth.copy_bytes_per_s / 1e9:.2f} GB/s  →  {bandwidth.fraction:.1%} of it" in text
    # On a CPU the load chose the linear kernels by measuring both; the step was timed with each,
    # alternating, and the reported step is the chosen one's (the bench's own load: the same
    # choice as the session's, kept for this machine).
    chosen = loaded.info.linear_kernels
    assert chosen in ("packed", "torch") and bandwidth.linear_kernels == chosen
    assert f"the load chose {bandwidth.kernels_reason}" in text and chosen in bandwidth.kernels_reason
    if packing_available():
        steps = {"packed": bandwidth.packed_decode_step_ms, "torch": bandwidth.torch_decode_step_ms}
        assert all(ms > 0 for ms in steps.values()) and bandwidth.decode_step_ms == steps[chosen]
        plain = bandwidth.torch_decode_step_ms
        assert bandwidth.fraction_at(plain) == pytest.approx(
            bandwidth.weight_bytes / (plain / 1e3) / bandwidth.copy_bytes_per_s
        )
        assert f"step with torch's own linear   {plain:7.1f} ms  →  {bandwidth.fraction_at(plain):.1%}" in text
    # The llama.cpp section: measured where llama.cpp is installed (the embedded model is a GGUF
    # file), else it says why not.
    llama = report.llamacpp
    assert llama is not None
    if llama_unavailable() is not None:
        assert llama.unavailable == llama_unavailable() and "llama.cpp engine: not measured" in text
        return
    assert llama.unavailable is None and llama.requests == 4
    assert llama.torch_tokens_per_s > 0 and llama.torch_peer_tokens_per_s > 0
    file, q8 = llama.weights
    assert (file.weights, q8.weights) == ("file", "Q8_0")
    assert "Q4_1" in file.weight_types and "Q8_0" in q8.weight_types and q8.file_mb > file.file_mb
    for w in llama.weights:
        assert 0 <= w.identical_prompts <= 4 and min(w.engine_tokens_per_s, w.peer_tokens_per_s) > 0
        assert w.ratio == pytest.approx(w.engine_tokens_per_s / w.peer_tokens_per_s)
        assert sorted(w.pass_cost) == [1, 2, 4, 8] and all(v > 0 for v in w.pass_cost.values())
        assert [p.batch_size for p in w.batches] == [1, 3] and all(p.tokens_per_s > 0 for p in w.batches)
        assert (w.variance is None) == (f"  {w.weights}: passes NOT invariant" not in text)
        quality = w.quality
        assert 0 <= quality.agreement <= 1 and 0 <= quality.greedy_match <= 1 and quality.greedy_tokens == 4
        assert quality.meets_floor == (quality.agreement >= BenchPlainConfig().min_agreement)
        assert f"  {w.weights:7s} {quality.agreement:9.2%} {quality.perplexity_delta:+12.2%}" in text
    # The file's own weights are the float target's, read with llama.cpp's 8-bit activations and
    # Q8_0 cache: close to it, not equal.
    assert file.quality.agreement > 0.8
    assert abs(file.quality.perplexity_delta) < 0.05


def test_bench_config_rejects_nonsense():
    with pytest.raises(ValidationError, match="max_tokens"):
        BenchPlainConfig(max_tokens=1)
    with pytest.raises(ValidationError, match="batch_sizes"):
        BenchPlainConfig(batch_sizes=[])
    with pytest.raises(ValidationError, match="batch_sizes.1"):
        BenchPlainConfig(batch_sizes=[4, 0])
