"""bench model-fit's error accounting over synthetic cells (the real run is in test_profiling.py)."""

import pytest

from backends.generation import GenerationResult
from backends.speculative.stats import SpeculationStats
from profiler.bench_model_fit import (
    PLAIN,
    SERVED,
    FitPoint,
    ModelFitConfig,
    PromptFit,
    ServedPoint,
    _backend_routing,
    _break_even,
    _Cell,
    _group,
    _Outlook,
    _predictor_fit,
    _prompt_fit,
    _routing,
    _steps,
    _wrong_share,
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
            alpha_rest=0.9,
            proposal_rate_rest=0.5,
            judged_tokens_rest=10,
            requested_steps_rest=40,
            alpha_predicted=0.6,
            proposal_rate_predicted=1.0,
            alpha_category=0.8,
            proposal_rate_category=1.0,
            alpha_online=0.75,
            proposal_rate_online=0.8,
        ),
        PromptFit(
            category="prose",
            prompt_id="b",
            prompt_tokens=200,
            alpha=0.0,
            proposal_rate=0.0,
            judged_tokens=0,  # never proposed: evidence for ρ, none for α
            requested_steps=60,
            alpha_rest=0.0,
            proposal_rate_rest=0.0,
            judged_tokens_rest=0,
            requested_steps_rest=0,  # the answer ended in its first half: no second half to compare
            alpha_predicted=0.2,
            proposal_rate_predicted=0.3,
            alpha_category=0.1,
            proposal_rate_category=1.0,
            alpha_online=0.2,
            proposal_rate_online=0.1,
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
    assert alpha.mae_online == pytest.approx(0.05) and rho.mae_online == pytest.approx((0.1 + 0.1) / 2)
    # The answer's halves: only prompts with evidence in both, weighted by the smaller half's.
    assert alpha.halves_prompts == 1 and alpha.mae_halves == pytest.approx(0.2)
    assert rho.halves_prompts == 1 and rho.mae_halves == pytest.approx(0.4) == rho.weighted_mae_halves


def stats(judged: int, accepted: int, requested: int, drafts: int) -> SpeculationStats:
    return SpeculationStats(
        drafter="ngram",
        k_mode="8",
        judged_tokens=judged,
        accepted_tokens=accepted,
        requested_steps=requested,
        drafts=drafts,
    )


def result(speculation: SpeculationStats) -> GenerationResult:
    return GenerationResult(
        text="",
        token_ids=[],
        finish_reason="length",
        prompt_tokens=120,
        completion_tokens=64,
        ttft_s=0.1,
        tpot_s=0.01,
        seed=0,
        speculation=speculation,
    )


def test_a_prompts_answer_is_split_into_its_halves():
    profile = synthetic_profile()
    measured = profile.acceptance_for("copy", "ngram")
    first, whole = result(stats(40, 30, 20, 10)), result(stats(100, 45, 60, 40))
    fit = _prompt_fit("copy", "a", first, whole, (0.7, 0.6), measured, (0.72, 0.65))
    assert (fit.alpha, fit.proposal_rate, fit.judged_tokens, fit.requested_steps) == (0.75, 0.5, 40, 20)
    assert (fit.alpha_rest, fit.judged_tokens_rest) == (pytest.approx(15 / 60), 60)
    assert (fit.proposal_rate_rest, fit.requested_steps_rest) == (pytest.approx(30 / 40), 40)
    assert (fit.alpha_predicted, fit.proposal_rate_predicted, fit.alpha_category) == (0.7, 0.6, measured.alpha)
    assert (fit.alpha_online, fit.proposal_rate_online) == (0.72, 0.65)
    # A step straddling the halves can give the second half more accepted than judged: clipped.
    straddling = _prompt_fit("copy", "a", first, result(stats(42, 33, 21, 11)), (0.7, 0.6), measured, (0.7, 0.6))
    assert straddling.alpha_rest == 1.0 and straddling.proposal_rate_rest == 1.0
    ended = _prompt_fit("copy", "a", first, first, (0.7, 0.6), measured, (0.7, 0.6))  # EOS in the first half
    assert ended.judged_tokens_rest == ended.requested_steps_rest == 0 and ended.alpha_rest == 0.0


def cells(served: float, alpha: float) -> dict[str, _Cell]:
    """A cell's engines: plain at 10 tokens/s, the served speculative backend `served` × that, and
    one fixed-k engine whose rows achieved `alpha` on every step."""
    return {
        PLAIN: _Cell(tokens=40, seconds=4.0),
        SERVED: _Cell(tokens=40, seconds=4.0 / served),
        "k=2": _Cell(tokens=40, seconds=4.0, prompt_stats=[(0, stats(100, round(100 * alpha), 50, 50))]),
    }


def test_a_backend_is_routed_by_the_policy_and_wrong_only_when_it_measured_slower():
    profile = synthetic_profile()  # ngram nearly free; the profile's 'copy' α 0.8
    config = ModelFitConfig(batches=[1], ks=[2], drafter="ngram")
    outlook = _Outlook(category="copy", context=100.0, tokens=[80], alphas=[0.85], rhos=[1.0])
    served = ServedPoint(
        category="copy",
        batch=1,
        tokens_per_s=15.0,
        measured=1.5,
        alpha=0.8,
        proposal_rate=1.0,
        mean_k=4,
        identical=True,
    )
    route = _backend_routing(served, cells(1.5, 0.05), outlook, profile, "ngram", config)
    assert route.best == "speculative" and route.served == 1.5
    assert route.chosen["predicted"] == route.chosen["profile"] == "speculative"
    assert route.loss["predicted"] == route.loss["profile"] == 0.0
    # The fixed-k runs accepted 5%: the policy would not speculate on that, and plain measured 1/1.5.
    assert route.chosen["run"] == "plain" and route.loss["run"] == pytest.approx(1 - 1 / 1.5)
    # Within WRONG_IF_SLOWER of each other, either backend is right.
    tie = _backend_routing(
        served.model_copy(update={"measured": 1.03}), cells(1.03, 0.05), outlook, profile, "ngram", config
    )
    assert tie.best == "speculative" and tie.chosen["run"] == "plain"
    # A served backend that verified no draft ran plain's passes: its 18% is noise, and plain is not wrong.
    silent = served.model_copy(update={"measured": 1.18, "mean_k": 0.0})
    assert _backend_routing(silent, cells(1.18, 0.05), outlook, profile, "ngram", config).loss["run"] == 0.0
    assert _wrong_share(list(tie.loss.values())) == 0.0 and _wrong_share(list(route.loss.values())) == pytest.approx(
        1 / 3
    )


def test_rows_need_room_for_whole_steps_of_the_largest_k():
    assert ModelFitConfig(ks=[2, 8], max_tokens=28).max_tokens == 28
    with pytest.raises(ValueError, match="max_tokens must be at least 28 with k up to 8"):
        ModelFitConfig(ks=[2, 8], max_tokens=27)
