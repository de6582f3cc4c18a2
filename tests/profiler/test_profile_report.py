"""The capacity-planning report on a synthetic profile whose closed forms fix every number: each
table row shows the measured values of its own batch, drafter or category, formatted."""

import pytest

from policies.profile import PredictorScore
from profiler.profile_report import render_profile
from tests.policies.profiles import BATCHES, FIXED, PER_TOKEN, step, synthetic_profile


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return render_profile(synthetic_profile(quantized_agreement=0.97)).splitlines()


def rows(lines: list[str], title: str) -> list[list[str]]:
    """The whitespace-split rows of the table under the line starting with `title`."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    table = []
    for line in lines[start + 2 :]:
        if not line.startswith("  "):
            break
        table.append(line.split())
    return table


def test_decode_scaling_rows_carry_step_time_throughput_and_regime(lines):
    table = {int(r[0]): r[1:] for r in rows(lines, "decode step by concurrency")}
    assert sorted(table) == BATCHES
    for b in (1, 64):
        s = step(b, 1)
        elasticity = PER_TOKEN * b / s  # d log t / d log b of fixed + per_token·b
        regime = "compute-bound" if elasticity >= 0.5 else "memory/overhead-bound"
        assert table[b] == [f"{s * 1e3:.1f}", f"{s * 1e3 / b:.2f}", f"{b / s:.1f}", f"{elasticity:.2f}", regime]
    assert table[1][-1] == "memory/overhead-bound" and table[64][-1] == "compute-bound"
    fit = f"fit: a step costs {FIXED * 1e3:.1f} ms whatever the batch + {PER_TOKEN * 1e3:.2f} ms per sequence"
    assert fit in lines
    knee = FIXED / PER_TOKEN  # elasticity 0.5 where per_token·b = fixed
    assert f"adding a sequence stops being nearly free from concurrency ≈ {knee:.0f} (elasticity ≥ 0.5)" in lines


def test_target_prefill_and_drafter_costs_show_the_profiled_seconds(lines):
    target = {int(r[0]): r[1:] for r in rows(lines, "target pass t(b, n)")}
    assert target[4][:3] == [f"{step(4, w) * 1e3:.1f}" for w in (1, 2, 3)]
    assert "prefill (time to first token, batch 1): 16 tokens 100 ms  256 tokens 500 ms" in lines
    drafters = {r[0]: r[1:] for r in rows(lines, "drafters: c =")}
    assert drafters["model:draft@bfloat16"] == ["0.400"] * len(BATCHES)  # 40 % of a target step at every batch


def test_acceptance_rows_show_each_categorys_measured_rates(lines):
    table = {(r[0], r[1]): r[2:] for r in rows(lines, "acceptance (greedy, fixed k)")}
    # k, ρ, α, rate (vLLM's accepted / drafted), then tokens per step, acc.len, γ, by position
    assert table[("copy", "ngram")][:4] == ["8", "1.00", "0.80", "0.80"]
    assert table[("sparse", "ngram")][:4] == ["8", "0.20", "0.90", "0.90"]
    assert table[("copy", "ngram")][7:10] == ["0.80", "0.64", "0.51"]  # α^(j+1): token j survives
    assert table[("prose", "model:draft@bfloat16")][:4] == ["8", "1.00", "0.90", "0.90"]


def test_the_quantized_section_says_what_speculation_on_it_measured():
    profile = synthetic_profile(quantized_agreement=0.97, quantized_alphas={"copy": 0.8, "prose": 0.1})
    lines = render_profile(profile).splitlines()
    q = profile.quantized
    assert q is not None
    v4 = q.curve.at(1, 5) / q.curve.at(1, 1)
    stacked = next(line for line in lines if line.startswith("int4-weight-only stacked with speculation: "))
    assert f"v(1,4) {v4:.2f}" in stacked
    assert "int4-weight-only with ngram, α on its own tokens: copy 0.80, prose 0.10" in lines
    assert all(r[0].isdigit() for r in rows(lines, "quantized backend"))  # the speed table ends before them


def test_the_quantized_section_shows_method_agreement_and_speed_against_the_target(lines):
    assert "quantized backend int4-weight-only (served): agreement with the target 97.0% (teacher-forced)" in lines
    table = {int(r[0]): r[1:] for r in rows(lines, "quantized backend")}
    for b in BATCHES:
        target = step(b, 1)
        int8 = step(b, 1, 0.6 * FIXED, 0.6 * PER_TOKEN)  # the profile's int8 curve: 0.6 × the target's
        assert table[b] == [f"{int8 * 1e3:.1f}", f"{target * 1e3:.1f}", f"{target / int8:.2f}×"]


def test_predictor_rows_show_each_error_both_baselines_and_the_chosen_model():
    scores = [
        PredictorScore(
            drafter="ngram",
            target="proposal_rate",
            folds=5,
            samples=70,
            mae_with_category=0.16,
            mae_text_only=0.17,
            mae_constant=0.226,
            mae_category_mean=0.197,
            model="ridge (text only: boosting)",
        ),
        PredictorScore(
            drafter="eagle", folds=5, samples=70, mae_with_category=0.07, mae_text_only=0.08, mae_constant=0.1
        ),
    ]
    profile = synthetic_profile().model_copy(update={"predictor": scores})
    table = rows(render_profile(profile).splitlines(), "α and ρ predictors")
    assert table[0][:8] == ["ngram", "ρ", "70", "5", "0.160", "0.170", "0.226", "0.197"]
    assert " ".join(table[0][8:]) == "ridge (text only: boosting)"
    assert table[1] == ["eagle", "α", "70", "5", "0.070", "0.080", "0.100", "—", "—"]  # scored before both existed


def test_the_context_table_reads_the_curves_at_each_context():
    from tests.policies.profiles import context_curve, with_context

    profile = synthetic_profile().model_copy(update={"context": context_curve()})
    table = {int(r[0]): r[1:] for r in rows(render_profile(profile).splitlines(), "by cached context")}
    assert sorted(table) == BATCHES
    for b in (1, 16):
        for i, n in enumerate((64, 512, 1024, 2048)):
            step_ms, v = table[b][2 * i : 2 * i + 2]
            assert step_ms == f"{with_context(b, 1, n) * 1e3:.1f}"
            assert v == f"{with_context(b, 9, n) / with_context(b, 1, n):.2f}"  # v(b, 8): the 9-wide pass
    assert not any(line.startswith("by cached context") for line in render_profile(synthetic_profile()).splitlines())
