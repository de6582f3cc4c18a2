import json

import pytest

from router.advise import backend_summaries, render_backends
from router.cli import main
from tests.policies.profiles import synthetic_profile


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    synthetic_profile(quantized_agreement=0.97).save(path)
    return path


def advise(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["advise", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_category_advice_as_json_has_the_decision_at_the_top(capsys, profile_path):
    code, out, _ = advise(capsys, "--category", "copy", "--concurrency", "1", "--profile", str(profile_path), "--json")
    assert code == 0
    advice = json.loads(out)
    assert {"backend", "drafter", "k", "reasons", "candidates"} <= advice.keys()
    assert advice["backend"] == "speculative" and advice["drafter"] == "ngram" and advice["k"] >= 1
    assert {c["backend"] for c in advice["candidates"]} == {"speculative", "plain", "quantized"}
    assert any(r.startswith("bottleneck:") for r in advice["reasons"])


def test_advice_moves_to_batching_and_quantization_under_load(capsys, profile_path):
    # At 64 sequences speculation on 'copy' is predicted short of min_speedup (the wider pass costs too much).
    code, out, _ = advise(capsys, "--category", "copy", "--concurrency", "64", "--profile", str(profile_path), "--json")
    assert code == 0 and json.loads(out)["backend"] == "quantized"
    policy = profile_path.parent / "policy.yaml"
    policy.write_text("quantization:\n  enabled: false\n")
    args = ["--category", "copy", "--concurrency", "64", "--profile", str(profile_path), "--policy", str(policy)]
    code, out, _ = advise(capsys, *args, "--json")
    assert code == 0 and json.loads(out)["backend"] == "plain"


def test_prompt_advice_predicts_alpha_and_prints_a_table(capsys, profile_path):
    code, out, _ = advise(capsys, "copy prompt 3", "--profile", str(profile_path))
    assert code == 0
    assert out.startswith("decision: ")
    assert "why:" in out and "speedup" in out and "TPOT ms" in out
    # The reason names what the α came from: the synthetic prompts' texts ("copy prompt 3") carry no
    # signal, so cross-validation chose the drafter's mean over a regression.
    assert "α̂=0.60 (model (mean of 18 samples))" in out
    # The same advice as JSON: its decision and every candidate's numbers appear in the text, formatted.
    code, raw, _ = advise(capsys, "copy prompt 3", "--profile", str(profile_path), "--json")
    advice = json.loads(raw)
    assert code == 0 and out.startswith(f"decision: {advice['backend']}")
    assert f"decided at the {advice['stage']} stage, concurrency {advice['concurrency']}" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith("  ")]
    for c in advice["candidates"]:
        prefix = f"  {c['backend']:12} {c['drafter'] or '—':36} "
        [row] = [r for r in rows if r.startswith(prefix)]
        alpha = "—" if c["alpha"] is None else f"{c['alpha']:.2f}"
        fields = row[len(prefix) :].split()
        assert fields[:2] == [alpha, f"{c['proposal_rate']:.2f}"] and fields[3] == f"{c['expected_tokens']:.2f}"
        measured = [f"{c['speedup']:.2f}×", f"{c['tpot_ms']:.1f}", f"{c['latency_ms']:.0f}", f"{c['tokens_per_s']:.1f}"]
        assert fields[6:10] == measured


@pytest.mark.parametrize(
    "args,message",
    [
        (["--category", "poetry"], "category 'poetry' was not profiled (profiled: copy, prose, sparse)"),
        (["--concurrency", "0", "--category", "copy"], "--concurrency counts this request too"),
        ([], "give a prompt (or --messages), a --category, or both"),
    ],
)
def test_bad_advice_requests_explain_themselves(capsys, profile_path, args, message):
    code, _, err = advise(capsys, *args, "--profile", str(profile_path))
    assert code == 2 and message in err


def test_missing_profile_and_bad_policy_are_user_errors(capsys, tmp_path, profile_path):
    code, _, err = advise(capsys, "--category", "copy", "--profile", str(tmp_path / "none.json"))
    assert code == 2 and "specroute profile" in err
    policy = tmp_path / "bad.yaml"
    policy.write_text("speculation:\n  k_max: 40\n")
    code, _, err = advise(capsys, "--category", "copy", "--profile", str(profile_path), "--policy", str(policy))
    assert code == 2 and "speculation.k_max" in err


def test_a_profile_of_another_model_is_refused_for_prompt_advice(capsys, tmp_path):
    profile = synthetic_profile()
    other = profile.model_copy(update={"model": profile.model.model_copy(update={"name": "other-model"})})
    path = tmp_path / "other.json"
    other.save(path)
    code, _, err = advise(capsys, "Hello", "--profile", str(path))
    assert code == 2 and "profiles other-model, not SmolLM2-135M-Instruct" in err


def test_advise_with_dtype_auto_reads_this_machines_profiles_and_says_which_dtype_serves(capsys, tmp_path, monkeypatch):
    from profiler.profiling import default_profile_path
    from tests.policies.profiles import in_dtype

    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    fp32 = synthetic_profile(quantized_agreement=0.97)
    fp32.save(default_profile_path("embedded", "float32", "cpu"))
    in_dtype(fp32, "bfloat16", 0.5).save(default_profile_path("embedded", "bfloat16", "cpu"))
    code, out, _ = advise(capsys, "--category", "copy")
    assert code == 0
    assert "dtype: bfloat16 (picked from this machine's profiles)" in out
    assert "profile: SmolLM2-135M-Instruct bfloat16" in out  # the decision read the bfloat16 profile
    dtype_rows = [line.split()[0] for line in out.splitlines() if line.startswith(("  float32 ", "  bfloat16 "))]
    assert dtype_rows == ["float32", "bfloat16"]
    code, out, _ = advise(capsys, "--category", "copy", "--dtype", "float32")
    assert "dtype: float32 (as configured)" in out and "profile: SmolLM2-135M-Instruct float32" in out


@pytest.mark.parametrize("kernels", ["packed", "torch", None])
def test_the_backends_table_counts_a_packed_copy_of_the_weights(kernels):
    profile = synthetic_profile(quantized_agreement=0.97)
    mib = 3 * 2**20
    profile = profile.model_copy(
        update={"model": profile.model.model_copy(update={"weight_bytes": mib, "linear_kernels": kernels})}
    )
    rows = backend_summaries(profile)
    assert [r.linear_kernels for r in rows] == [kernels, kernels, None]  # the quantized target has its own layers
    lines = render_backends(rows)[1:]
    packed = [line for line in lines if "+ packed copy 3 MiB" in line]
    assert [line.split()[0] for line in packed] == (["speculative", "plain"] if kernels == "packed" else [])


def test_the_backends_table_says_what_the_quantized_backend_speculates_with():
    stacked = backend_summaries(
        synthetic_profile(quantized_agreement=0.97, quantized_alphas={"copy": 0.8, "prose": 0.2})
    )
    assert stacked[2].drafters == {"ngram": pytest.approx(0.5)}  # weighted by judged tokens, equal here
    assert "speculates with ngram (α 0.50 on it)" in render_backends(stacked)[3]
    plain = backend_summaries(synthetic_profile(quantized_agreement=0.97))
    assert plain[2].drafters == {} and "speculates" not in render_backends(plain)[3]
