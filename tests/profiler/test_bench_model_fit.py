"""bench model-fit's error accounting over synthetic cells (the real run is in test_profiling.py)."""

import pytest

from profiler.bench_model_fit import (
    FitPoint,
    ModelFitConfig,
    PromptFit,
    _break_even,
    _group,
    _predictor_fit,
    _routing,
    _steps,
)
from tests.policies.profiles import synthetic_profile


def point(
    category: str, batch: int, k: int, measured: float, predicted: float, prompt: float, profile: float
) -> FitPoint:
    return FitPoint(
        category=category,
        batch=batch,
        k=k,
        alpha=0.5,
        proposal_rate=1.0,
        alpha_profile=0.8,
        proposal_rate_profile=1.0,
        plain_tokens_per_s=10.0,
        spec_tokens_per_s=10.0 * measured,
        measured=measured,
        predicted=predicted,
        predicted_profile=profile,
        alpha_predicted=0.6,
        proposal_rate_predicted=1.0,
        predicted_prompt=prompt,
        context=300.0,
        identical=True,
        tokens=40,
        plain_seconds=4.0,
        spec_seconds=4.0 / measured,
    )


def test_a_routing_choice_is_wrong_only_when_it_measured_slower():
    cell = [point("copy", 4, 2, 1.30, 1.25, 1.10, 0.90), point("copy", 4, 4, 1.20, 1.30, 1.05, 0.95)]
    check = _routing("copy", 4, cell)
    assert check.best == "k=2"
    assert check.chosen_run == "k=4" and check.loss_run == pytest.approx(1 - 1.20 / 1.30)  # 7.7 % slower: wrong
    assert check.chosen_predicted == "k=2" and check.loss_predicted == 0
    assert check.chosen_profile == "plain" and check.loss_profile == pytest.approx(1 - 1 / 1.30)
    # Predicting plain where plain is measured fastest is right; a tie goes to plain.
    losing = _routing("copy", 16, [point("copy", 16, 2, 0.8, 1.0, 0.7, 0.9)])
    assert losing.best == "plain" and losing.chosen_run == "plain" and losing.loss_run == 0


def test_errors_group_per_category_and_batch():
    cells = [point("copy", 1, 2, 2.0, 2.2, 1.8, 1.0), point("copy", 1, 4, 1.0, 0.9, 1.0, 1.0)]
    group = _group("copy", cells)
    assert group.cells == 2 and group.mape == pytest.approx(10.0)
    assert group.mape_predicted == pytest.approx(5.0) and group.mape_profile_alpha == pytest.approx(25.0)


def test_break_even_error_is_counted_in_grid_steps():
    grid = [1, 4, 16]
    assert _steps(grid, 4, 4) == 0 and _steps(grid, 4, 16) == 1 and _steps(grid, 1, None) == 3
    config = ModelFitConfig(batches=grid, ks=[2], categories=["code"])
    profile = synthetic_profile()
    points = [
        point("copy", 1, 2, 1.5, 1.4, 1.3, 1.2),
        point("copy", 4, 2, 0.9, 1.1, 0.95, 1.2),
        point("copy", 16, 2, 0.7, 0.8, 0.9, 1.1),
    ]
    points = [p.model_copy(update={"category": "copy"}) for p in points]
    config = config.model_copy(update={"categories": None, "drafter": "ngram"})
    be = _break_even("copy", points, profile, config)
    assert (be.measured, be.predicted, be.predicted_prompt) == (4, 16, 4)
    assert be.steps_off == 1 and be.steps_off_prompt == 0


def test_the_predictor_is_scored_per_prompt_beside_the_category_mean_and_a_constant():
    profile = synthetic_profile()  # ngram: α 0.8 copy, 0.1 prose, 0.9 sparse; ρ 1, 1, 0.2
    fits = [
        PromptFit(
            category="copy",
            prompt_id="a",
            prompt_tokens=300,
            alpha=0.7,
            proposal_rate=0.9,
            judged_tokens=50,
            requested_steps=20,
            alpha_predicted=0.6,
            proposal_rate_predicted=1.0,
            alpha_category=0.8,
            proposal_rate_category=1.0,
        ),
        PromptFit(
            category="prose",
            prompt_id="b",
            prompt_tokens=200,
            alpha=0.0,
            proposal_rate=0.0,
            judged_tokens=0,  # never proposed: evidence for ρ, none for α
            requested_steps=60,
            alpha_predicted=0.2,
            proposal_rate_predicted=0.3,
            alpha_category=0.1,
            proposal_rate_category=1.0,
        ),
    ]
    alpha, rho = _predictor_fit(fits, profile, "ngram")
    assert alpha.target == "alpha" and alpha.prompts == 1
    assert alpha.mae_predictor == pytest.approx(0.1) and alpha.mae_category == pytest.approx(0.1)
    assert alpha.mae_constant == pytest.approx(abs(0.6 - 0.7), abs=0.01)  # (0.8 + 0.1 + 0.9) / 3 over equal judged
    assert rho.prompts == 2 and rho.mae_predictor == pytest.approx((0.1 + 0.3) / 2)
    assert rho.mae_category == pytest.approx((0.1 + 1.0) / 2)
    # Weighted by evidence: the prompt that asked 60 times counts three times the one that asked 20.
    assert alpha.weighted_mae_predictor == pytest.approx(0.1)
    assert rho.weighted_mae_predictor == pytest.approx((0.1 * 20 + 0.3 * 60) / 80)
    assert rho.weighted_mae_category == pytest.approx((0.1 * 20 + 1.0 * 60) / 80)
