import pytest

from policies.calibration import Calibration, ServiceCalibration, load_bucket, predicted_tpot_ms, predicted_ttft_ms
from policies.config import CalibrationConfig
from policies.estimates import BACKENDS
from policies.policy import decide
from tests.policies.profiles import synthetic_profile
from tests.policies.test_policy import features, load
from tests.policies.test_policy import policy as base_policy


def policy(**overrides: object):
    """The test policy with calibration switched on (it is off by default)."""
    calibration = {"enabled": True, **overrides.pop("calibration", {})}  # type: ignore[dict-item]
    return base_policy(calibration=calibration, **overrides)


def calibrated(**factors: float) -> Calibration:
    """Every backend measured enough at concurrency 1, with these factors."""
    return Calibration(bucket=1, factors=factors, observations=dict.fromkeys(BACKENDS, 8))


@pytest.mark.parametrize(("concurrency", "bucket"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (64, 64)])
def test_loads_are_bucketed_at_powers_of_two(concurrency, bucket):
    assert load_bucket(concurrency) == bucket


def test_a_factor_is_the_median_of_enough_ratios_at_that_load():
    calibration = ServiceCalibration(CalibrationConfig(min_observations=3))
    for measured in (150, 160, 400):  # one slow outlier does not move a median
        calibration.observe("tpot", "plain", 1, 100, measured)
    at = calibration.at(1, BACKENDS)
    assert at.factors["plain"] == pytest.approx(1.6)
    assert at.observations == {"speculative": 0, "plain": 3, "quantized": 0}
    assert at.sources["plain"] == "3 requests"


def test_too_few_ratios_give_no_factor():
    calibration = ServiceCalibration(CalibrationConfig(min_observations=3))
    calibration.observe("tpot", "plain", 1, 100, 150)
    calibration.observe("tpot", "plain", 1, 100, 150)
    assert calibration.at(1, BACKENDS).factors == {}


def test_an_unmeasured_load_borrows_the_nearest_and_an_unmeasured_backend_the_others_median():
    calibration = ServiceCalibration(CalibrationConfig(min_observations=1))
    calibration.observe("tpot", "plain", 2, 100, 150)
    calibration.observe("tpot", "plain", 64, 100, 110)
    calibration.observe("tpot", "speculative", 1, 100, 190)
    at = calibration.at(4, BACKENDS)
    assert at.factors["plain"] == pytest.approx(1.5) and at.sources["plain"] == "1 requests at concurrency ~2"
    assert at.factors["speculative"] == pytest.approx(1.9)
    assert at.factors["quantized"] == pytest.approx(1.7)  # median of 1.5 and 1.9
    assert at.sources["quantized"].startswith("not measured here yet")
    assert at.observations == {"speculative": 0, "plain": 0, "quantized": 0}


def test_the_window_keeps_the_latest_ratios():
    calibration = ServiceCalibration(CalibrationConfig(window=2, min_observations=1))
    for measured in (300, 100, 100):
        calibration.observe("tpot", "plain", 1, 100, measured)
    assert calibration.at(1, BACKENDS).factors["plain"] == pytest.approx(1.0)
    calibration.observe("ttft", "plain", 1, 100, 250)
    assert calibration.summary() == {"plain": {1: {"tpot": 1.0, "requests": 2, "ttft": 2.5}}}
    calibration.clear()
    assert calibration.summary() == {}


def test_a_measured_factor_turns_a_predicted_speculation_gain_into_plain():
    profile = synthetic_profile()
    alone = decide(features("copy", ngram=0.5), load(1), profile, policy())
    spec = next(c for c in alone.candidates if c.backend == "speculative")
    assert alone.backend == "speculative" and spec.speedup > 1.1
    # The service runs speculation as much slower than profiled, relative to plain, as it was predicted to gain.
    slower = spec.speedup
    slowed = calibrated(plain=1.5, speculative=1.5 * slower, quantized=1.5)
    decision = decide(features("copy", ngram=0.5), load(1), profile, policy(), calibration=slowed)
    after = next(c for c in decision.candidates if c.backend == "speculative")
    assert decision.backend == "plain"
    assert after.speedup == pytest.approx(1.0)
    assert after.tpot_ms == pytest.approx(spec.tpot_ms * 1.5 * slower)
    assert any(r.startswith("calibration: measured in this service") for r in decision.reasons)


def test_a_backend_measured_faster_than_profiled_is_chosen():
    profile = synthetic_profile(quantized_agreement=0.99, quantized_speed=1.0)  # profiled as fast as plain
    config = policy(speculation={"enabled": False})
    assert decide(features("prose"), load(1), profile, config).backend == "plain"
    measured = calibrated(plain=1.5, speculative=1.5, quantized=1.1)
    decision = decide(features("prose"), load(1), profile, config, calibration=measured)
    assert (decision.backend, decision.stage) == ("quantized", "quantization")


def test_calibration_off_in_the_policy_uses_the_profile_alone():
    profile = synthetic_profile()
    slowed = calibrated(plain=1.0, speculative=3.0)
    off = base_policy()  # the default
    decision = decide(features("copy", ngram=0.5), load(1), profile, off, calibration=slowed)
    assert decision.backend == "speculative"
    assert not any(r.startswith("calibration") for r in decision.reasons)


def test_a_close_unmeasured_backend_is_explored_and_a_far_one_is_not():
    profile = synthetic_profile(quantized_agreement=0.99, quantized_speed=1.1)  # 10 % slower than plain
    config = policy(speculation={"enabled": False})
    fresh = Calibration(bucket=1, factors={"plain": 1.2, "quantized": 1.2}, observations={"plain": 5, "quantized": 1})
    decision = decide(features("prose"), load(1), profile, config, calibration=fresh)
    assert (decision.backend, decision.stage) == ("quantized", "exploration")
    assert any("quantized backend has 1 of 3 requests measured" in r for r in decision.reasons)
    measured = fresh.model_copy(update={"observations": {"plain": 5, "quantized": 3}})
    assert decide(features("prose"), load(1), profile, config, calibration=measured).backend == "plain"
    cold = fresh.model_copy(update={"observations": {"plain": 2, "quantized": 0}})  # the choice is measured first
    assert decide(features("prose"), load(1), profile, config, calibration=cold).backend == "plain"
    far = synthetic_profile(quantized_agreement=0.99, quantized_speed=2.0)
    assert decide(features("prose"), load(1), far, config, calibration=fresh).backend == "plain"
    never = policy(speculation={"enabled": False}, calibration={"explore_within": None})
    assert decide(features("prose"), load(1), profile, never, calibration=fresh).backend == "plain"


def test_exploring_never_picks_what_the_policy_rules_out():
    profile = synthetic_profile(quantized_agreement=0.60, quantized_speed=1.0)  # under the quality floor
    config = policy(speculation={"enabled": False})
    fresh = Calibration(bucket=1, factors={}, observations={"plain": 5})
    assert decide(features("prose"), load(1), profile, config, calibration=fresh).backend == "plain"


def test_the_prediction_a_finished_request_is_judged_against():
    profile = synthetic_profile(quantized_agreement=0.99)
    plain = predicted_tpot_ms(profile, "plain", None, 1, 100, 64, (1, 8))
    assert plain is not None and plain > 0
    good = predicted_tpot_ms(profile, "speculative", "ngram", 1, 100, 64, (1, 8), achieved=(0.9, 1.0))
    poor = predicted_tpot_ms(profile, "speculative", "ngram", 1, 100, 64, (1, 8), achieved=(0.1, 1.0))
    assert good is not None and poor is not None and good < poor and good < plain / 2
    quantized = predicted_tpot_ms(profile, "quantized", None, 1, 100, 64, (1, 8))
    assert quantized == pytest.approx(plain * 0.6, rel=0.05)
    assert predicted_tpot_ms(profile, "speculative", "ngram", 1, 100, 64, (1, 8)) is None  # nothing achieved
    assert predicted_tpot_ms(profile, "speculative", "nobody", 1, 100, 64, (1, 8), achieved=(0.5, 1.0)) is None
    assert predicted_tpot_ms(synthetic_profile(), "quantized", None, 1, 100, 64, (1, 8)) is None


def test_a_backend_that_prefills_slower_than_profiled_loses_a_short_answer_it_would_win_per_token():
    profile = synthetic_profile(quantized_agreement=0.99, quantized_speed=0.8)
    config = policy(speculation={"enabled": False})
    short = features("prose").model_copy(update={"max_tokens": 8})
    assert decide(short, load(1), profile, config).backend == "quantized"
    # Decode as profiled, but its first token 3× later than predicted (its prefill kernels are slower).
    measured = Calibration(
        bucket=1,
        factors={"plain": 1.0, "quantized": 1.0},
        ttft_factors={"plain": 1.0, "quantized": 3.0},
        observations={"plain": 5, "quantized": 5},
    )
    decision = decide(short, load(1), profile, config, calibration=measured)
    assert decision.backend == "plain"
    quantized = next(c for c in decision.candidates if c.backend == "quantized" and c.drafter is None)
    plain = next(c for c in decision.candidates if c.backend == "plain")
    assert quantized.tpot_ms < plain.tpot_ms and quantized.latency_ms > plain.latency_ms
    assert any("quantized 1.00× per token, 3.00× to the first" in r for r in decision.reasons)


def test_the_first_token_a_finished_request_is_judged_against_is_its_uncached_prefill():
    profile = synthetic_profile(quantized_agreement=0.99)
    whole = predicted_ttft_ms(profile, "plain", 1, 400)
    assert whole is not None and predicted_ttft_ms(profile, "plain", 1, 400, cached_tokens=300) < whole
    assert predicted_ttft_ms(profile, "quantized", 1, 400) is not None
    assert predicted_ttft_ms(synthetic_profile(), "quantized", 1, 400) is None
