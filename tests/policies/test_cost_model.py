import math

import numpy as np
import pytest

from policies.cost_model import (
    RowOutlook,
    best_speculative_k,
    break_even_concurrency,
    effective_verify_costs,
    elasticity,
    expected_tokens,
    knee,
    per_token_seconds,
    plan_step,
    run_speedup,
    speedup,
    step_cost,
    step_model,
    tokens_per_step,
)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95])
@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_expected_tokens_is_the_geometric_series(alpha, k):
    assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def test_expected_tokens_at_full_acceptance_is_k_plus_one():
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(np.array([0.5, 1.0]), 3) == pytest.approx([1.875, 4.0])


@pytest.mark.parametrize("alpha,k", [(0.6, 3), (0.85, 6), (0.2, 2)])
def test_expected_tokens_matches_a_monte_carlo_of_acceptance(alpha, k):
    rng = np.random.default_rng(7)
    draws = 200_000
    accepted = rng.random((draws, k)) < alpha
    emitted = 1 + np.cumprod(accepted, axis=1).sum(axis=1)  # leading accepts + the target's token
    standard_error = emitted.std() / np.sqrt(draws)
    assert abs(emitted.mean() - expected_tokens(alpha, k)) < 4 * standard_error


def test_speedup_is_tokens_over_cost_and_one_for_a_plain_step():
    assert speedup(0.8, 0, c=0.5, v=1.0) == 1.0
    assert speedup(0.8, 4, c=0.05, v=1.2) == pytest.approx(expected_tokens(0.8, 4) / (4 * 0.05 + 1.2))
    with pytest.raises(ValueError, match=r"step cost must be positive \(k=0, c=0\.0, v=0\.0\)"):
        speedup(0.5, 0, c=0.0, v=0.0)


def test_a_runs_speedup_is_its_steps_expected_tokens_over_their_costs():
    # Steps that all drafted k at one width are the closed form; a step with no draft yields one token.
    alpha, k, c, v = 0.7, 3, 0.04, 1.25
    assert run_speedup(alpha, [k] * 10, [v] * 10, 10 * k * c) == pytest.approx(speedup(alpha, k, c, v))
    assert run_speedup(0.9, [0, 0], [1.0, 1.0], 0.0) == 1.0
    mixed = run_speedup(0.5, [2, 0, 4], [1.3, 1.0, 1.6], 0.2)
    assert mixed == pytest.approx((1.75 + 1.0 + 1.9375) / (0.2 + 1.3 + 1.0 + 1.6))
    with pytest.raises(ValueError, match="one pass cost per step"):
        run_speedup(0.5, [1, 2], [1.0], 0.0)


def _solo(alpha: float, cap: int = 8, drafter: str = "d", rho: float = 1.0) -> RowOutlook:
    return RowOutlook(drafter, alpha, rho, cap)


PASS_S = [0.050 * v for v in (1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.6)]


def test_a_lone_row_drafts_more_as_acceptance_grows_and_not_at_all_when_it_cannot_pay():
    assert plan_step([_solo(0.05)], PASS_S, {"d": 0.015}, k_max=8) == [0]
    low, high = plan_step([_solo(0.5)], PASS_S, {"d": 0.0025}, 8), plan_step([_solo(0.95)], PASS_S, {"d": 0.0025}, 8)
    assert 0 < low[0] < high[0]


def test_the_plan_respects_caps_and_k_max_and_prefers_less_drafting_on_ties():
    flat = [0.05] * 9
    assert plan_step([_solo(1.0, cap=3)], flat, {}, k_max=8) == [3]
    assert plan_step([_solo(1.0)], flat, {}, k_max=2) == [2]
    assert plan_step([_solo(0.0)], flat, {}, k_max=8) == [0]  # every k emits one token for the same cost


def test_rows_share_the_pass_width_so_a_weak_row_drafts_along_with_a_strong_one():
    plan = plan_step([_solo(0.95, cap=6), _solo(0.05, cap=2), RowOutlook(None, 0.0, 0.0, 0)], PASS_S, {"d": 0.0}, 8)
    assert plan[0] > 2 and plan[1] == 2 and plan[2] == 0  # drafting is free once the pass is wide anyway


def test_a_costly_drafter_sits_out_while_a_free_one_drafts_in_the_same_pass():
    rows = [_solo(0.8, drafter="ngram"), _solo(0.3, drafter="model")]
    plan = plan_step(rows, PASS_S, {"ngram": 0.0, "model": 0.04}, k_max=8)
    assert plan[0] > 0 and plan[1] == 0


def test_a_drafter_that_must_first_catch_up_on_a_long_context_waits():
    rows = [_solo(0.9)]
    assert plan_step(rows, PASS_S, {"d": 0.002}, k_max=8)[0] > 0
    assert plan_step(rows, PASS_S, {"d": 0.002}, k_max=8, catch_up_seconds={"d": 0.5}) == [0]


def test_at_a_compute_bound_batch_no_row_drafts():
    # Each extra token per row costs nearly a whole pass: decode is compute-bound here.
    steep = [0.3 * w for w in range(1, 10)]
    rows = [_solo(0.6) for _ in range(32)]
    assert plan_step(rows, steep, {"d": 0.001}, k_max=8) == [0] * 32


def test_a_rarely_proposing_drafter_pays_the_wide_pass_only_when_it_proposes():
    rows = [_solo(0.7, drafter="ngram", rho=0.1)]
    costly = [0.05 * (1 + 0.5 * (w - 1)) for w in range(1, 10)]
    assert plan_step(rows, costly, {"ngram": 0.0}, k_max=8) == [1]
    # Charged a wide pass on every step, the same single draft would lose.
    assert tokens_per_step(0.7, 1, 0.1) / (costly[1] / costly[0]) < 1


# ---- the additions the policy uses ----


def test_best_speculative_k_stays_in_range_even_when_it_loses():
    verify = [1.0, 1.5, 2.0, 2.5]
    k, gain = best_speculative_k(0.0, 0.1, verify, k_min=1, k_max=3)
    assert k == 1 and gain == pytest.approx(1 / 1.6)
    assert best_speculative_k(0.99, 0.0, [1.0] * 9, k_min=2, k_max=5)[0] == 5
    with pytest.raises(ValueError, match=r"need 1 <= k_min <= k_max \(got k_min=0, k_max=3\)"):
        best_speculative_k(0.5, 0.0, verify, k_min=0)


def test_verify_costs_pad_to_the_cheapest_wider_pass():
    # Widths 2 and 3 run slower than 4 (as MKL does here): a 1- or 2-draft block pads to width 4.
    assert effective_verify_costs([1.0, 1.6, 2.0, 1.2, 1.3]) == pytest.approx([1.0, 1.2, 1.2, 1.2, 1.3])
    with pytest.raises(ValueError, match="need positive pass times"):
        effective_verify_costs([1.0, 0.0])


def test_per_token_seconds_is_step_cost_over_tokens():
    assert per_token_seconds(0.1, 0.5, 0, 0.3, 1.0) == pytest.approx(0.1)
    assert per_token_seconds(0.1, 0.5, 2, 0.1, 1.2) == pytest.approx(0.1 * 1.4 / 1.75)


def test_step_model_recovers_fixed_and_per_sequence_costs():
    batches = [1, 2, 4, 8, 16, 32, 64]
    seconds = [0.07 + 0.0025 * b for b in batches]
    fixed, per_sequence = step_model(batches, seconds)
    assert fixed == pytest.approx(0.07) and per_sequence == pytest.approx(0.0025)
    assert elasticity(batches, seconds, 16) == pytest.approx(0.04 / 0.11)
    assert knee(batches, seconds) == pytest.approx(28.0)  # fixed == per_sequence · b
    assert knee(batches, seconds, threshold=0.75) == pytest.approx(84.0)


def test_a_flat_curve_never_turns_compute_bound_and_a_linear_one_always_is():
    batches = [1, 2, 4, 8]
    assert knee(batches, [0.1, 0.1, 0.1, 0.1]) is None
    assert elasticity(batches, [0.1, 0.1, 0.1, 0.1], 64) == 0.0
    assert elasticity(batches, [0.1 * b for b in batches], 1) == pytest.approx(1.0)
    assert elasticity(batches, [0.12, 0.1, 0.11, 0.1], 4) == 0.0  # noise that falls is not a cost


def test_break_even_matches_the_closed_form():
    """t(b, w) = F + P·b·w, c = 0, k = 1: speedup(b) = (1 + α)(F + Pb) / (F + 2Pb) < 1 from
    b* = αF / (P(1 − α))."""
    f, p, alpha = 0.07, 0.0025, 0.55  # b* ≈ 34.2

    def gain(b: int) -> float:
        return speedup(alpha, 1, 0.0, (f + 2 * p * b) / (f + p * b))

    b_star = alpha * f / (p * (1 - alpha))
    assert break_even_concurrency(gain, b_max=100) == math.floor(b_star) + 1
    assert break_even_concurrency(gain, b_max=30) is None


def test_a_step_without_proposals_runs_a_plain_pass():
    assert step_cost(4, 0.0, 1.5, proposal_rate=1.0) == pytest.approx(1.5)
    assert step_cost(4, 0.0, 1.5, proposal_rate=0.0) == pytest.approx(1.0)
    # One sequence of two proposing is enough to widen the shared pass: q = 1 − (1 − ρ)^b.
    assert step_cost(4, 0.01, 1.5, proposal_rate=0.4, batch=2) == pytest.approx(0.04 + 0.64 * 1.5 + 0.36)
    assert step_cost(0, 0.3, 1.0) == 1.0
    assert speedup(0.5, 2, 0.0, 1.5, proposal_rate=0.5) == pytest.approx((1 + 0.5 * 0.75) / 1.25)


def test_proposal_rate_matches_a_monte_carlo_of_a_batch():
    rng = np.random.default_rng(3)
    rho, batch, v = 0.3, 4, 2.0
    proposes = rng.random((100_000, batch)) < rho
    simulated = np.where(proposes.any(axis=1), v, 1.0).mean()
    assert step_cost(3, 0.0, v, proposal_rate=rho, batch=batch) == pytest.approx(simulated, abs=0.01)


def test_tokens_per_step_matches_a_monte_carlo_of_sparse_proposals():
    """Only a share ρ of steps propose (prompt lookup without a match); those accept each token with
    α. The mixture emits 1 + ρ·(E(α, k) − 1) per step at every k, not E(pooled α, k)."""
    rng = np.random.default_rng(11)
    rho, alpha, draws = 0.3, 0.9, 200_000
    for k in (1, 2, 8):
        proposes = rng.random(draws) < rho
        accepted = np.cumprod(rng.random((draws, k)) < alpha, axis=1).sum(axis=1) * proposes
        emitted = 1 + accepted
        standard_error = emitted.std() / np.sqrt(draws)
        assert abs(emitted.mean() - tokens_per_step(alpha, k, rho)) < 4 * standard_error
    assert tokens_per_step(0.5, 3) == pytest.approx(expected_tokens(0.5, 3))


def _proposal(*acceptance: float, drafter: str = "d") -> RowOutlook:
    return RowOutlook(drafter, 0.0, 1.0, len(acceptance), tuple(acceptance))


def test_a_drafted_proposal_is_verified_up_to_where_its_predicted_gain_stops_paying():
    # The expected extra tokens of verifying j positions are Σ_{i≤j} Π_{m≤i} a_m.
    row = _proposal(0.95, 0.9, 0.9, 0.05, 0.9, 0.9)
    assert row.gain(3) == pytest.approx(0.95 + 0.95 * 0.9 + 0.95 * 0.9 * 0.9)
    costly = [0.05 * (1 + 0.15 * (w - 1)) for w in range(1, 10)]
    assert plan_step([row], costly, {}, k_max=8, drafted={"d": 6}) == [3]
    # A proposal nobody expects to pass is not verified at all: the step stays a 1-token pass.
    assert plan_step([_proposal(0.04, 0.9)], costly, {}, k_max=8, drafted={"d": 2}) == [0]


def test_drafting_already_done_costs_nothing_more_while_each_further_step_does():
    row = RowOutlook("d", 0.8, 1.0, 6, (0.9, 0.85))  # two drawn; later positions expected at α = 0.8
    dear = {"d": 0.03}
    assert plan_step([row], PASS_S, dear, k_max=8, drafted={"d": 2}) == [2]  # stop drawing
    assert plan_step([row], PASS_S, {"d": 0.0005}, k_max=8, drafted={"d": 2})[0] > 2  # cheap: draw on


def test_time_already_spent_drafting_counts_in_every_option_of_the_step():
    row = _proposal(0.3)
    costly = [0.05, 0.05 * 1.35] + [0.05 * 1.5] * 7
    assert plan_step([row], costly, {}, k_max=8, drafted={"d": 1}) == [0]
    # Once the step has paid for a slow draft, the wide pass is a smaller share of its time.
    assert plan_step([row], costly, {}, k_max=8, drafted={"d": 1}, spent_seconds=0.1) == [1]
