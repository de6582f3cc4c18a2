import pytest

from policies.capacity import (
    Acceptance,
    CurveModel,
    PolicyRouter,
    SpeculativeModel,
    backend_model,
    backend_of,
    kv_bytes,
    replica_key,
    router_for,
    summarize,
    usd_per_million,
)
from policies.config import PolicyConfig, default_policy
from policies.cost_model import best_speculative_k, tokens_per_step
from policies.estimates import ProfileCosts, QuantizedCosts, prefill_scale
from policies.simulation import LoopLimits, SimRecord, SimRequest, simulate_closed

from .profiles import FIXED, PER_TOKEN, curve, step, synthetic_profile

NGRAM = "ngram"


def request(i: int = 0, category: str | None = "copy", prompt: int = 40, output: int = 10) -> SimRequest:
    return SimRequest(id=i, prompt_tokens=prompt, output_tokens=output, category=category)


def test_a_plain_step_is_the_profiled_one_token_pass_and_prefill_the_prefill_curve():
    profile = synthetic_profile()
    model = CurveModel(profile, profile.target)
    seconds, tokens = model.decode_step([request(i) for i in range(4)])
    assert seconds == pytest.approx(step(4, 1))
    assert tokens == [1.0] * 4
    assert model.prefill_seconds(136, 2) == pytest.approx(0.1 + (0.5 - 0.1) * 120 / 240)


def test_one_speculative_row_drafts_the_k_the_cost_model_rates_best():
    profile = synthetic_profile()
    alpha = 0.8
    model = SpeculativeModel(profile, {0: Acceptance(NGRAM, alpha, 1.0)}, k_max=8)
    seconds, tokens = model.decode_step([request()])
    costs = ProfileCosts(profile)
    c = costs.draft_cost(profile.drafter(NGRAM), 1)
    k, _ = best_speculative_k(alpha, c, costs.verify_costs(1), 1, 8)
    assert tokens == [pytest.approx(tokens_per_step(alpha, k))]
    assert seconds == pytest.approx(k * 1e-4 + step(1, k + 1))


def test_rows_without_a_drafter_ride_the_pass_as_plain_rows():
    profile = synthetic_profile()
    model = SpeculativeModel(profile, {0: Acceptance(NGRAM, 0.9, 1.0)}, k_max=8)
    seconds, tokens = model.decode_step([request(0), request(1)])
    assert tokens[1] == 1.0 and tokens[0] > 1.0
    alone, _ = SpeculativeModel(profile, {}, k_max=8).decode_step([request(0), request(1)])
    assert alone == pytest.approx(step(2, 1))  # nobody drafts: a 1-token pass
    assert seconds > alone


def test_a_row_that_rarely_proposes_pays_the_wide_pass_only_when_it_does():
    profile = synthetic_profile()
    rho = 0.2
    model = SpeculativeModel(profile, {0: Acceptance(NGRAM, 0.9, rho)}, k_max=8)
    seconds, tokens = model.decode_step([request(0)])
    k = _k_from(tokens[0], 0.9, rho)
    assert seconds == pytest.approx(k * 1e-4 + rho * step(1, k + 1) + (1 - rho) * step(1, 1))


def _k_from(tokens: float, alpha: float, rho: float) -> int:
    return next(k for k in range(1, 9) if tokens_per_step(alpha, k, rho) == pytest.approx(tokens))


def test_the_router_speculates_where_the_policy_does_and_batches_elsewhere():
    profile = synthetic_profile()
    router = PolicyRouter(profile, PolicyConfig(speculation={"drafters": [NGRAM]}), "auto")
    assert backend_of(router(request(0, "copy"), {})) == "speculative"
    assert router.chosen[0] == Acceptance(NGRAM, 0.8, 1.0)
    assert backend_of(router(request(1, "prose"), {})) == "plain"
    assert 1 not in router.chosen
    # Under heavy load the policy stops speculating even on the copy category.
    assert backend_of(router(request(2, "copy"), {replica_key("plain", 0): 63})) == "plain"


def test_a_speculating_quantized_backend_is_simulated_on_its_own_passes_and_alpha():
    profile = synthetic_profile(quantized_agreement=0.99, quantized_alphas={"copy": 0.7, "prose": 0.1})
    q = profile.quantized
    assert q is not None
    router = PolicyRouter(profile, PolicyConfig(speculation={"drafters": [NGRAM]}), "auto")
    assert backend_of(router(request(0, "copy"), {})) == "quantized"
    assert router.chosen[0] == Acceptance(NGRAM, 0.7, 1.0)  # measured on the quantized model, not the target's 0.8
    model = backend_model(profile, "quantized", router.chosen, 8)
    assert isinstance(model, SpeculativeModel)
    seconds, tokens = model.decode_step([request(0)])
    k = _k_from(tokens[0], 0.7, 1.0)
    assert seconds == pytest.approx(k * 1e-4 + q.curve.at(1, k + 1), rel=1e-6)  # its own verify pass
    assert model.prefill_seconds(136, 0) == pytest.approx(
        CurveModel(profile, profile.target).prefill_seconds(136, 0) * 0.6
    )
    # without α measured on it, the quantized backend decodes plain
    assert isinstance(backend_model(synthetic_profile(quantized_agreement=0.99), "quantized", {}, 8), CurveModel)


def test_quantized_prefill_scales_by_the_step_ratio_at_the_concurrency_as_the_policy_predicts():
    profile = synthetic_profile(quantized_agreement=0.99)
    assert profile.quantized is not None
    # the saving shrinks with the batch: weight bytes are read once per step, compute per row is the target's
    quantized = profile.quantized.model_copy(update={"curve": curve(FIXED * 0.3, PER_TOKEN)})
    profile = profile.model_copy(update={"quantized": quantized})
    model, base = backend_model(profile, "quantized", {}, 8), CurveModel(profile, profile.target)
    alone, loaded = (model.prefill_seconds(136, r) / base.prefill_seconds(136, r) for r in (0, 7))
    assert alone == pytest.approx(prefill_scale(quantized.curve, profile.target, 1))
    assert loaded == pytest.approx(prefill_scale(quantized.curve, profile.target, 8))
    assert alone < loaded < 1
    costs = ProfileCosts(profile)
    assert QuantizedCosts(costs, 8).ttft_s(136) / costs.ttft_s(136) == pytest.approx(loaded)


def test_a_forced_mode_takes_its_backend_and_replicas_share_the_load():
    profile = synthetic_profile()
    router = PolicyRouter(profile, default_policy(), "plain", replicas=3)
    load = {replica_key("plain", 0): 2, replica_key("plain", 1): 0, replica_key("plain", 2): 1}
    assert router(request(0, "copy"), load) == "plain#1"
    forced = PolicyRouter(profile, default_policy(), "speculative")
    assert forced(request(1, "prose"), {}) == "speculative#0"
    assert 1 in forced.chosen  # forced speculation still drafts, with the drafter rated best


def test_the_policy_decides_with_each_replicas_own_load():
    """Six plain requests over three replicas: the request joins a machine running two, not six."""
    profile = synthetic_profile()
    router = PolicyRouter(profile, default_policy(), "auto", replicas=3)
    load = {replica_key("plain", i): 2 for i in range(3)}
    _, _, decision = router._decide(request(0, "copy"), load)
    assert decision.concurrency == 3
    single = PolicyRouter(profile, default_policy(), "auto", replicas=1)
    assert single._decide(request(0, "copy"), {replica_key("plain", 0): 6})[2].concurrency == 7


def test_requests_sharing_a_prefix_stay_on_its_replica_until_it_runs_too_far_ahead():
    profile = synthetic_profile()
    router = PolicyRouter(profile, default_policy(), "plain", replicas=2)
    shared = SimRequest(id=0, prompt_tokens=700, output_tokens=10, category="copy", shared_prefix=600)
    load = {replica_key("plain", 0): 0, replica_key("plain", 1): 0}
    assert router(shared, load) == "plain#0"
    load["plain#0"] = 3  # within the default bound (4) of plain#1's 0: the warm replica keeps it
    assert router(shared, load) == "plain#0"
    load["plain#0"] = 5
    assert router(shared, load) == "plain#1"
    alone = SimRequest(id=1, prompt_tokens=700, output_tokens=10, category="copy")
    assert router(alone, {"plain#0": 1, "plain#1": 2}) == "plain#0"  # no shared prefix: least loaded


def test_measured_acceptance_of_a_prompt_wins_over_its_category_mean():
    profile = synthetic_profile()
    measured = {0: {NGRAM: Acceptance(NGRAM, 0.33, 0.5)}}
    policy = PolicyConfig(speculation={"drafters": [NGRAM]})
    router = PolicyRouter(profile, policy, "speculative", acceptance_of=measured)
    router(request(0, "copy"), {})
    router(request(1, "copy"), {})  # no measurement of its own: the category's mean
    assert router.chosen[0] == Acceptance(NGRAM, 0.33, 0.5)
    assert router.chosen[1] == Acceptance(NGRAM, 0.8, 1.0)


def test_a_closed_loop_of_one_plain_client_runs_at_the_profiled_step_rate():
    profile = synthetic_profile()
    route, backends, _ = router_for(profile, default_policy(), "plain")
    requests = [request(i, "prose", prompt=16, output=101) for i in range(5)]
    records = simulate_closed(requests, 1, backends, route, LoopLimits())
    decode = [(r.finished_s - r.first_token_s) / 100 for r in records]
    assert decode == [pytest.approx(FIXED + PER_TOKEN)] * 5
    summary = summarize(records, ttft_ms=1e9, tpot_ms=1e9, replicas=1)
    assert summary.busy_share == pytest.approx(1.0)
    assert summary.peak_rows == 1 and summary.attainment == 1.0


def test_summary_counts_requests_meeting_both_targets():
    records = [
        SimRecord(request(0, output=11), "plain#0", 0.0, 0.0, 0.5, 1.5),  # TTFT 500 ms, TPOT 100 ms
        SimRecord(request(1, output=11), "plain#0", 0.0, 0.0, 2.5, 3.5),  # TTFT too slow
        SimRecord(request(2, output=11), "plain#1", 4.0, 4.0, 4.1, 9.1),  # TPOT 500 ms: too slow
    ]
    s = summarize(records, ttft_ms=1000, tpot_ms=200, replicas=2)
    assert s.attainment == pytest.approx(1 / 3)
    assert s.tokens_per_s == pytest.approx(33 / 9.1)
    assert s.busy_share == pytest.approx((3.5 + 5.1) / (9.1 * 2))
    assert s.peak_rows == 2
    assert s.mean_requests == pytest.approx((1.5 + 3.5 + 5.1) / (9.1 * 2))


def test_cost_arithmetic():
    assert usd_per_million(2, 0.08, 10.0) == pytest.approx(0.16 / 36_000 * 1e6)
    assert usd_per_million(1, 0.08, 0.0) is None
    assert kv_bytes(46080, 4, 100.5) == 46080 * 402
    assert kv_bytes(None, 4, 10) is None


def test_a_routed_replica_is_busy_while_any_of_its_backends_is():
    records = [
        SimRecord(request(0), "speculative#0", 0.0, 0.0, 0.5, 2.0),
        SimRecord(request(1), "plain#0", 1.0, 1.0, 1.5, 3.0),  # overlaps the speculative one on replica 0
        SimRecord(request(2), "plain#1", 0.0, 0.0, 0.5, 1.0),
    ]
    s = summarize(records, ttft_ms=1e9, tpot_ms=1e9, replicas=2)
    assert s.busy_share == pytest.approx((3.0 + 1.0) / (3.0 * 2))
    assert s.mean_requests == pytest.approx((2.0 + 2.0 + 1.0) / (3.0 * 2))
    assert s.peak_rows == 2  # replica 0's two backends held one request each at t = 1..2


def test_simulated_steps_read_the_curves_at_the_rows_decode_context():
    from policies.capacity import CONTEXT_GRAIN, batch_context
    from tests.policies.profiles import context_curve, with_context

    rows = [SimRequest(id=i, prompt_tokens=850 + 100 * i, output_tokens=200) for i in range(4)]
    assert batch_context(rows) == round(1100 / CONTEXT_GRAIN) * CONTEXT_GRAIN  # mean prompt 1000 + half of 200
    profile = synthetic_profile(quantized_agreement=0.99).model_copy(update={"context": context_curve()})
    plain = backend_model(profile, "plain", {}, 8)
    assert plain.decode_step(rows)[0] == pytest.approx(with_context(4, 1, batch_context(rows)))
    # The quantized model's weights are cheaper; reading the cache costs it what it costs the target.
    quantized = backend_model(profile, "quantized", {}, 8)
    grown = with_context(4, 1, batch_context(rows)) - step(4, 1)
    assert quantized.decode_step(rows)[0] == pytest.approx(profile.quantized.curve.at(4, 1) + grown)
