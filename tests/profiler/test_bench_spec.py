import json

import pytest
from pydantic import ValidationError

from backends.engines.llamacpp import llama_unavailable
from profiler.bench_spec import BenchSpecConfig, _engine_label, render_report, run_bench_spec
from router.cli import main

from ..conftest import NATIVE_BF16_ONLY

pytestmark = pytest.mark.slow


def test_bench_spec_compares_every_configuration_on_the_same_prompts(loaded):
    config = BenchSpecConfig(
        max_tokens=6,
        categories=["rag"],
        prompts_per_category=1,
        drafters=["ngram"],
        fixed_k=2,
        k_max=3,
        calibration_prompts=2,
        calibration_tokens=24,
    )
    report = run_bench_spec(config)
    [category] = report.categories
    names = [run.name for run in category.runs]
    assert names == ["plain", "ngram k=2", "ngram k=auto", "transformers prompt lookup"]
    for run in category.runs:
        assert run.identical, f"{run.name} produced different greedy tokens"
        assert run.tokens_per_s == pytest.approx(run.tokens / run.seconds)
    plain = category.runs[0].tokens_per_s
    auto = category.runs[2]
    assert auto.speedup == pytest.approx(auto.tokens_per_s / plain)
    assert auto.acceptance_rate is not None and category.runs[3].acceptance_rate is None
    ratio = category.versus_transformers["ngram k=auto / transformers prompt lookup"]
    assert ratio == pytest.approx(auto.tokens_per_s / category.runs[3].tokens_per_s)
    assert set(report.step_costs_ms) >= {"1", "2", "3", "4"}
    text = render_report(report)
    assert "rag (1 prompts)" in text and "ours over transformers" in text
    # One row per configuration, in order, with its measured numbers: tok/s, speedup, α, ..., same tokens.
    rows = text.split("\nrag (1 prompts)\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    for run, row in zip(category.runs, rows, strict=False):
        prefix = f"  {run.name:28} "
        assert row.startswith(prefix), (run.name, row)
        fields = row[len(prefix) :].split()
        alpha = "—" if run.acceptance_rate is None else f"{run.acceptance_rate:.2f}"
        decode, model = (
            "—" if value is None else f"{value:.2f}×" for value in (run.decode_speedup, run.predicted_speedup)
        )
        assert fields[:5] == [f"{run.tokens_per_s:.1f}", f"{run.speedup:.2f}×", decode, model, alpha]
        assert fields[-1] == "yes"
    auto_fields = rows[2][len(f"  {auto.name:28} ") :].split()
    assert auto_fields[5:8] == [f"{auto.mean_accepted_length:.2f}", f"{auto.gamma:.3f}", f"{auto.mean_k:.1f}"]
    # Decoding alone (after the first token) for every run timed per token, plain's own 1×; the cost
    # model's speedup for each speculative run (its α, its steps' widths, the probed costs).
    assert category.runs[0].decode_speedup == pytest.approx(1.0) and category.runs[3].decode_speedup is None
    assert all(run.decode_speedup > 0 for run in category.runs[:3])
    assert [run.predicted_speedup is not None for run in category.runs] == [False, True, True, False]
    assert all(0.0 < run.predicted_speedup < config.k_max + 1 for run in category.runs[1:3])
    predicted = report.geomean_predicted["ngram k=auto"]
    assert f" {report.geomean_decode['ngram k=auto']:6.2f}× {predicted:6.2f}×" in text
    assert f"  ours over transformers: ngram k=auto / transformers prompt lookup = {ratio:.2f}×" in rows
    # Timed on the held-out set, with the acceptance map fitted on the project set and scored on both.
    assert report.config.prompt_set == "heldout" and "of the heldout set" in text
    fitted, live = report.calibration
    assert (fitted.prompt_set, fitted.how, live.prompt_set, live.how) == ("project", "out of fold", "heldout", "live")
    assert fitted.positions > 0 and live.positions > 0
    ratio = report.auto_versus_best_fixed["ngram"]["rag"]
    assert ratio == pytest.approx(auto.tokens_per_s / category.runs[1].tokens_per_s)
    assert f"rag {ratio:.2f}" in text


@pytest.mark.skipif(llama_unavailable() is not None, reason="llama-cpp-python is not installed here")
def test_bench_spec_on_the_llama_cpp_engine_faces_llama_cpps_own_generation(loaded):
    config = BenchSpecConfig(
        engine="llamacpp",
        max_tokens=8,
        categories=["rag"],
        prompts_per_category=1,
        drafters=["ngram"],
        fixed_k=2,
        k_max=3,
        calibrate=False,
    )
    report = run_bench_spec(config)
    [category] = report.categories
    runs = {run.name: run for run in category.runs}
    assert list(runs) == ["plain", "llama.cpp generate", "plain, float32", "ngram k=2", "ngram k=auto"]
    assert runs["ngram k=2"].identical and runs["ngram k=auto"].identical  # exact to the engine's plain loop
    assert set(category.versus_transformers) == {"plain / llama.cpp generate", "ngram k=auto / llama.cpp generate"}
    ratio = category.versus_transformers["plain / llama.cpp generate"]
    assert ratio == pytest.approx(runs["plain"].tokens_per_s / runs["llama.cpp generate"].tokens_per_s)
    assert "Q4_1" in report.model["gguf_types"] and set(report.step_costs_ms) >= {"1", "2", "3", "4"}
    text = render_report(report)
    one = report.step_costs_ms["1"]
    assert f"k=1: {report.step_costs_ms['2'] / one:.2f}" in text and "llama.cpp engine, " in text
    assert f"  ours over llama.cpp: plain / llama.cpp generate = {ratio:.2f}×" in text
    assert "requantized" not in text and report.model["peer_gguf_types"] == report.model["gguf_types"]


def test_requantized_weights_are_named_beside_the_file_llama_cpps_own_generation_runs():
    model = {"gguf_types": "llama 256M Q8_0", "gguf_weights": "Q8_0", "peer_gguf_types": "llama 256M Q4_1"}
    label = _engine_label(BenchSpecConfig(engine="llamacpp", gguf_weights="Q8_0"), model)
    assert label == (
        "llama.cpp engine, llama 256M Q8_0 requantized from the file; llama.cpp's own generation runs it as "
        "shipped, llama 256M Q4_1"
    )
    with pytest.raises(ValidationError, match="--gguf-weights Q8_0 requantizes the file .* add --engine llamacpp"):
        BenchSpecConfig(gguf_weights="Q8_0")


def test_bench_spec_cli_writes_json(tmp_path, capsys, loaded):
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--max-tokens", "4", "--categories", "qa", "--prompts", "1", "--drafters", "ngram"]
    code = main(
        [*argv, "--no-transformers", "--fixed-k", "1,2", "--prompt-set", "project", "--no-calibrate", "--out", str(out)]
    )
    assert code == 0 and "results written to" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["categories"][0]["category"] == "qa" and saved["config"]["prompt_set"] == "project"
    assert [r["name"] for r in saved["categories"][0]["runs"]] == ["plain", "ngram k=1", "ngram k=2", "ngram k=auto"]
    assert all(s["how"] == "live" for s in saved["calibration"])  # no map was fitted first


@NATIVE_BF16_ONLY
def test_bench_spec_in_bfloat16_runs_beside_the_float32_plain_loop(loaded_bf16):
    """The exact reference is the width-invariant plain loop; the float32 plain loop is timed in the
    same run, and every configuration's speedup over it reported."""
    config = BenchSpecConfig(
        dtype="bfloat16",
        max_tokens=6,
        categories=["summarization"],
        prompts_per_category=1,
        drafters=["ngram"],
        fixed_k=4,
        transformers=False,
        calibrate=False,
    )
    report = run_bench_spec(config)
    [category] = report.categories
    runs = {run.name: run for run in category.runs}
    assert list(runs) == ["plain", "plain, natural widths", "plain, float32", "ngram k=4", "ngram k=auto"]
    assert runs["ngram k=4"].identical and runs["ngram k=auto"].identical
    over = report.geomean_over_float32
    assert set(over) == set(runs) - {"plain, float32"}
    assert over["plain"] == pytest.approx(runs["plain"].tokens_per_s / runs["plain, float32"].tokens_per_s)
    text = render_report(report)
    assert f"  {'ngram k=auto':28} {over['ngram k=auto']:6.2f}×  exact" in text


def test_unknown_category_is_refused(loaded):
    with pytest.raises(ValueError, match="unknown categories"):
        run_bench_spec(BenchSpecConfig(categories=["poetry"], drafters=["ngram"], transformers=False))


def test_bench_spec_config_rejects_nonsense():
    with pytest.raises(ValidationError, match=r"(?s)drafters\.0\s+Input should be .*'ngram'"):
        BenchSpecConfig(drafters=["magic"])
    with pytest.raises(ValidationError, match=r"max_tokens\s+Input should be greater than or equal to 2"):
        BenchSpecConfig(max_tokens=1)
    with pytest.raises(ValidationError, match="distinct integers from 1 to 32"):
        BenchSpecConfig(fixed_k=[2, 2])
