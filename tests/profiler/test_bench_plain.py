import pytest
from pydantic import ValidationError

from backends.packing import is_packed
from profiler.bench_plain import BenchPlainConfig, render_report, run_bench_plain

pytestmark = pytest.mark.slow


def test_bench_plain_reports_a_side_by_side_ratio_and_bandwidth(loaded):
    report = run_bench_plain(BenchPlainConfig(max_tokens=4, batch_sizes=[1, 3], rounds=1))
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
    # The embedded model runs packed linear layers on a CPU; the same step with torch's own
    # linear was timed beside it, and the model is left packed for whoever runs next.
    assert is_packed(loaded.model)
    assert bandwidth.unpacked_decode_step_ms > 0
    weight_s = bandwidth.weight_bytes / bandwidth.copy_bytes_per_s
    assert bandwidth.unpacked_fraction == pytest.approx(weight_s / (bandwidth.unpacked_decode_step_ms / 1e3))
    assert f"step with torch's own linear   {bandwidth.unpacked_decode_step_ms:7.1f} ms" in text


def test_bench_config_rejects_nonsense():
    with pytest.raises(ValidationError, match="max_tokens"):
        BenchPlainConfig(max_tokens=1)
    with pytest.raises(ValidationError, match="batch_sizes"):
        BenchPlainConfig(batch_sizes=[])
    with pytest.raises(ValidationError, match="batch_sizes.1"):
        BenchPlainConfig(batch_sizes=[4, 0])
