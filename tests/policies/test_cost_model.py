import numpy as np
import pytest

from policies.cost_model import best_k, expected_tokens, speedup


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
    with pytest.raises(ValueError):
        speedup(0.5, 0, c=0.0, v=0.0)


def test_best_k_grows_with_acceptance_and_is_zero_when_drafting_cannot_pay():
    verify = [1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.6]
    assert best_k(0.05, 0.3, verify)[0] == 0
    low, high = best_k(0.5, 0.05, verify), best_k(0.95, 0.05, verify)
    assert 0 < low[0] < high[0]
    assert high[1] > low[1] > 1.0


def test_best_k_respects_k_max_and_prefers_the_smaller_k_on_ties():
    verify = [1.0] * 9
    assert best_k(1.0, 0.0, verify, k_max=3)[0] == 3
    assert best_k(0.0, 0.0, verify)[0] == 0  # every k emits one token for the same cost: take k = 0
