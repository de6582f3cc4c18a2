import numpy as np
import pytest

from backends.speculative.acceptance import (
    BUFFER,
    CONFIDENCE_FEATURES,
    MIN_OUTCOMES,
    OFFSET_LIMIT,
    REFIT_EVERY,
    REFIT_FIRST,
    AcceptancePredictor,
    confidence_features,
    constant_map,
    fit_map,
    refine_offset,
)


def _synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions whose acceptance is σ(2·confidence − 1): a map must find that out."""
    rng = np.random.default_rng(seed)
    confidence = rng.normal(0.0, 1.5, n)
    x = np.stack([confidence, rng.random(n), rng.integers(0, 8, n)], axis=1)
    y = (rng.random(n) < 1 / (1 + np.exp(-(2 * confidence - 1)))).astype(float)
    return x, y, rng.integers(0, 20, n)


def test_a_fitted_map_beats_a_constant_out_of_fold_and_is_calibrated():
    x, y, groups = _synthetic(4000)
    fitted = fit_map("d", CONFIDENCE_FEATURES, x, y, groups)
    assert fitted.coef[0] == pytest.approx(2.0, abs=0.3) and fitted.intercept == pytest.approx(-1.0, abs=0.3)
    assert fitted.brier < 0.8 * fitted.brier_constant
    assert fitted.samples == 4000 and fitted.prompts == 20
    populated = [b for b in fitted.reliability if b.count >= 100]
    assert len(populated) >= 5
    assert all(abs(b.mean_predicted - b.accepted_share) < 0.08 for b in populated)
    assert sum(b.count for b in fitted.reliability) == 4000


def test_with_one_outcome_only_the_map_is_a_constant():
    x, _, _ = _synthetic(50)
    fitted = fit_map("d", CONFIDENCE_FEATURES, x, np.ones(50))
    assert fitted.coef == [0.0, 0.0, 0.0] and fitted.brier is None
    assert AcceptancePredictor("d", CONFIDENCE_FEATURES, fitted).predict(x[:1])[0] == pytest.approx(51 / 52)


def test_a_request_offset_follows_its_outcomes_and_is_bounded():
    rejected = refine_offset(0.0, np.array([0.8, 0.8]), [1.0, 0.0])
    assert rejected == pytest.approx(0.3 * (0.2 - 0.8))
    offset = 0.0
    for _ in range(100):
        offset = refine_offset(offset, np.array([0.9]), [0.0])
    assert offset == -OFFSET_LIMIT
    assert refine_offset(1.5, np.zeros(0), []) == 1.5


def test_the_loop_fits_its_own_map_once_it_has_judged_enough_and_keeps_a_given_one_until_outnumbered():
    x, y, _ = _synthetic(3000, seed=1)
    own = AcceptancePredictor("d", CONFIDENCE_FEATURES, prior=0.5)
    assert own.predict(x[:2]).tolist() == pytest.approx([0.5, 0.5])
    own.learn(x[:REFIT_FIRST], y[:REFIT_FIRST], group=0)
    assert own.map.samples == REFIT_FIRST and own.map.coef[0] > 0.5
    given = fit_map("d", CONFIDENCE_FEATURES, x[:1000], y[:1000])
    predictor = AcceptancePredictor("d", CONFIDENCE_FEATURES, given)
    predictor.learn(x[1000:1999], y[1000:1999], group=1)
    assert predictor.map is given  # 999 own positions do not outnumber the 1000 it was fitted on
    predictor.learn(x[1999:2100], y[1999:2100], group=2)
    assert predictor.map is not given and predictor.map.samples == 1100
    assert len(predictor.x) <= BUFFER


def test_traffic_of_one_outcome_does_not_replace_the_map():
    """Positions that were all rejected (traffic with nothing to copy) cannot tell proposals apart:
    the map in use stays; once both outcomes are there in numbers, the loop fits its own."""
    x, y, _ = _synthetic(2000, seed=2)
    given = fit_map("d", CONFIDENCE_FEATURES, x[:64], y[:64])
    predictor = AcceptancePredictor("d", CONFIDENCE_FEATURES, given)
    predictor.learn(x[64:400], np.zeros(336), group=1)
    assert predictor.map is given
    rejected_then_mixed = np.concatenate([np.zeros(MIN_OUTCOMES), y[400 : 400 + REFIT_EVERY]])
    assert rejected_then_mixed.sum() >= MIN_OUTCOMES
    predictor.learn(x[400 : 400 + len(rejected_then_mixed)], rejected_then_mixed, group=2)
    assert predictor.map is not given and predictor.map.samples == len(predictor.y)


def test_live_scores_are_the_predictions_acted_on():
    predictor = AcceptancePredictor("d", CONFIDENCE_FEATURES)
    assert predictor.live_score() is None
    x, _, _ = _synthetic(4)
    predictor.learn(x, [1.0, 1.0, 0.0, 0.0], group=0, predicted=[0.9, 0.7, 0.2, 0.4])
    positions, brier, constant, bins = predictor.live_score()
    assert positions == 4 and brier == pytest.approx((0.01 + 0.09 + 0.04 + 0.16) / 4) and constant == 0.25
    assert [b.count for b in bins] == [1, 1, 1, 1]


def test_a_map_for_other_features_is_refused():
    with pytest.raises(ValueError, match="reads"):
        AcceptancePredictor("d", CONFIDENCE_FEATURES, constant_map("d", ["match"], 0.5))


def test_confidence_features_are_logit_entropy_and_position():
    features = confidence_features(np.array([0.5, 1.0]), np.array([0.7, 0.0]), position=3)
    assert features[0].tolist() == pytest.approx([0.0, 0.7, 3.0])
    assert features[1, 0] == pytest.approx(9.0)  # certainty is clipped, not infinite


def test_with_nothing_judged_the_fitted_map_is_the_one_in_use():
    predictor = AcceptancePredictor("d", CONFIDENCE_FEATURES, prior=0.3)
    assert predictor.fitted() is predictor.map and predictor.map.samples == 0
