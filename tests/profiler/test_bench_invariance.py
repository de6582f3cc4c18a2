import pytest
from pydantic import ValidationError

from backends.engines.llamacpp import llama_unavailable
from profiler.bench_invariance import BenchInvarianceConfig, render_report, run_bench_invariance

from ..conftest import NATIVE_BF16_ONLY

pytestmark = pytest.mark.slow


@NATIVE_BF16_ONLY
def test_bench_invariance_compares_every_way_of_computing_a_request_in_every_mode(loaded_bf16):
    config = BenchInvarianceConfig(dtype="bfloat16", prompts_per_category=1, max_tokens=6, batch_sizes=[7])
    report = run_bench_invariance(config)
    assert report.model["dtype"] == "bfloat16" and report.drafter == "ngram"
    compared = [(a.width_invariant, a.compared, a.batch_size) for a in report.agreements]
    assert compared == [
        (mode, what, batch)
        for mode in ("alone", "every-pass", "off")
        for what, batch in [
            ("speculative vs plain", 1),
            ("plain batched vs plain alone", 7),
            ("speculative batched vs plain alone", 7),
        ]
    ]
    assert all(a.prompts == 7 and 0 <= a.identical <= 7 for a in report.agreements)
    # The guarantee width-invariant passes give on any machine: speculation is plain decoding at batch 1.
    assert report.agreements[0].identical == 7
    assert [(s.width_invariant, s.tile) for s in report.speeds] == [("alone", 9), ("every-pass", 9), ("off", None)]
    assert all(s.tokens_per_s > 0 and s.batched_tokens_per_s > 0 and s.batch_size == 7 for s in report.speeds)
    lines = render_report(report).splitlines()
    for a in report.agreements:
        assert [a.width_invariant, *a.compared.split(), str(a.batch_size), str(a.identical), "of", "7"] in [
            line.split() for line in lines
        ]
    first = report.speeds[0]
    assert (
        f"  tiled passes alone      (tile 9): {first.tokens_per_s:.1f} tok/s alone, "
        f"{first.batched_tokens_per_s:.1f} tok/s in batches of 7"
    ) in lines


@pytest.mark.skipif(llama_unavailable() is not None, reason="llama-cpp-python is not installed here")
def test_on_the_llama_cpp_engine_every_way_of_computing_gives_the_same_tokens(loaded):
    """One mode (no tiles), every proposal verified (fixed k): the engine's attention settings make
    speculative and batched output equal to plain output alone (the categories with short prompts:
    llama.cpp prefills ~150 tokens/s here)."""
    config = BenchInvarianceConfig(
        engine="llamacpp",
        k=3,
        categories=["chat", "qa"],
        prompts_per_category=2,
        max_tokens=16,
        batch_sizes=[3],
    )
    report = run_bench_invariance(config)
    assert report.engine == "llamacpp" and report.k == "3"
    assert [(a.width_invariant, a.compared, a.batch_size) for a in report.agreements] == [
        ("off", "speculative vs plain", 1),
        ("off", "plain batched vs plain alone", 3),
        ("off", "speculative batched vs plain alone", 3),
    ]
    assert all(a.identical == a.prompts == 4 for a in report.agreements), render_report(report)
    assert "llamacpp engine" in render_report(report)


def test_bench_invariance_config_rejects_nonsense():
    with pytest.raises(ValidationError, match="batch_sizes"):
        BenchInvarianceConfig(batch_sizes=[1])
    with pytest.raises(ValidationError, match="drafter"):
        BenchInvarianceConfig(drafter="telepathy")
    with pytest.raises(ValueError, match="unknown categories"):
        run_bench_invariance(BenchInvarianceConfig(categories=["poetry"]))
