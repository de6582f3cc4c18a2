import subprocess
import sys

import pytest

from policies.config import PolicyConfig, parse_policy
from policies.policy import AlphaInput, LoadSnapshot, RequestFeatures, decide
from policies.profile import DrafterProfile, Profile
from tests.policies.profiles import ALPHAS, acceptance, step, synthetic_profile

NGRAM_ONLY = {"speculation": {"drafters": ["ngram"]}}


def features(category: str | None = "copy", **alphas: float) -> RequestFeatures:
    given = {name: AlphaInput(alpha=a, source="test") for name, a in alphas.items()}
    return RequestFeatures(prompt_tokens=100, max_tokens=64, category=category, alphas=given)


def load(concurrency: int, memory: float | None = None) -> LoadSnapshot:
    return LoadSnapshot(in_flight={"plain": concurrency - 1}, memory_utilization=memory)


def policy(**overrides: object) -> PolicyConfig:
    return parse_policy({**NGRAM_ONLY, **overrides})


def test_low_load_and_high_alpha_speculate_and_say_why():
    decision = decide(features("copy"), load(1), synthetic_profile(), policy())
    assert (decision.backend, decision.drafter, decision.stage) == ("speculative", "ngram", "speculation")
    assert decision.k is not None and decision.k >= 2
    assert decision.bottleneck == "memory"
    text = "\n".join(decision.reasons)
    assert "memory/overhead-bound" in text and "α̂=0.80" in text and "→ speculate" in text
    chosen = decision.chosen()
    assert (
        chosen.speedup > 1.1 and chosen.tpot_ms < next(c for c in decision.candidates if c.backend == "plain").tpot_ms
    )


def test_high_load_goes_to_the_large_batch_backend():
    decision = decide(features("copy"), load(64), synthetic_profile(), policy())
    assert (decision.backend, decision.stage, decision.bottleneck) == ("plain", "batching", "compute")
    assert any("compute-bound" in r for r in decision.reasons)
    assert any(r.startswith("batching: the large-batch plain backend") for r in decision.reasons)


def test_compute_bound_decode_still_speculates_where_the_cost_model_says_it_pays():
    # At 32 sequences a step grows as b^0.53 (compute-bound), but with α 0.95 drafts pay for the
    # wider verify pass, v(b, k), that the cost model prices at this load.
    decision = decide(features("copy", ngram=0.95), load(32), synthetic_profile(), policy())
    assert (decision.bottleneck, decision.backend, decision.stage) == ("compute", "speculative", "speculation")
    assert decision.chosen().speedup > 1.1 and decision.chosen().v > 1.5
    strict = policy(bottleneck={"skip_speculation_when_compute_bound": True})
    skipped = decide(features("copy", ngram=0.95), load(32), synthetic_profile(), strict)
    assert (skipped.backend, skipped.stage) == ("plain", "batching")
    assert any("skipped: decode is compute-bound at this load (policy)" in r for r in skipped.reasons)


@pytest.mark.parametrize("concurrency", [1, 2, 4, 8, 16, 32, 64])
def test_low_alpha_never_speculates(concurrency):
    decision = decide(features("prose"), load(concurrency), synthetic_profile(), policy())
    assert decision.backend == "plain"
    speculative = next(c for c in decision.candidates if c.backend == "speculative")
    assert speculative.alpha == pytest.approx(0.1)


def test_low_alpha_reason_names_the_threshold():
    decision = decide(features("prose"), load(1), synthetic_profile(), policy())
    assert any("< 1.1× required → do not speculate" in r for r in decision.reasons)


def test_predicted_alpha_overrides_the_category_mean():
    decision = decide(features("prose", ngram=0.85), load(1), synthetic_profile(), policy())
    assert decision.backend == "speculative"
    assert decision.chosen().alpha_source == "test"


def test_without_alpha_or_category_speculation_is_not_guessed():
    decision = decide(features(None), load(1), synthetic_profile(), policy())
    assert decision.backend == "plain"
    assert any("no α estimate for ngram" in r for r in decision.reasons)


def test_the_best_drafter_wins_among_candidates():
    # The model drafter accepts 0.99 but costs 40 % of a step; at α 0.8 prompt lookup is nearly free.
    both = parse_policy({"speculation": {"drafters": ["ngram", "model"]}})
    decision = decide(features("copy"), load(1), synthetic_profile(model_alpha=0.99), both)
    specs = [c for c in decision.candidates if c.backend == "speculative"]
    assert len(specs) == 2
    assert decision.drafter == max(specs, key=lambda c: c.speedup).drafter


def test_speculation_follows_the_cost_model_break_even():
    """With t = F + P·b·w, c ≈ 0 and k = 1 the closed-form break-even is b* = αF / (P(1 − α)):
    the policy's speculative candidate must cross 1× there."""
    profile = synthetic_profile()
    one = policy(speculation={"drafters": ["ngram"], "k_max": 1}, bottleneck={"compute_bound_elasticity": 0.99})
    alpha, f, p = 0.5, 0.070, 0.0025
    b_star = alpha * f / (p * (1 - alpha))  # 28
    below = decide(features("copy", ngram=alpha), load(int(b_star) - 2), profile, one)
    above = decide(features("copy", ngram=alpha), load(int(b_star) + 2), profile, one)
    assert below.candidates[0].speedup > 1.0 > above.candidates[0].speedup
    assert below.candidates[0].k == above.candidates[0].k == 1


def test_the_batch_is_each_backends_load_per_replica_summed():
    assert LoadSnapshot(in_flight={"plain": 7}).concurrency == 8
    assert LoadSnapshot(in_flight={"plain": 7}, replicas={"plain": 2}).concurrency == 4
    # one replica of each backend shares a machine: 4 plain over 2 replicas and 3 speculative on one
    assert LoadSnapshot(in_flight={"plain": 4, "speculative": 3}, replicas={"plain": 2}).concurrency == 6
    assert (
        LoadSnapshot(in_flight={"plain": 3, "speculative": 3}, replicas={"plain": 2, "speculative": 2}).concurrency == 4
    )


def test_max_concurrency_caps_speculation():
    decision = decide(features("copy"), load(4), synthetic_profile(), policy(speculation={"max_concurrency": 4}))
    assert decision.backend == "plain"
    assert any("speculate below concurrency 4" in r for r in decision.reasons)


def test_concurrency_override_replaces_the_live_load():
    decision = decide(features("copy"), load(1), synthetic_profile(), policy(concurrency_override=64))
    assert decision.concurrency == 64 and decision.backend == "plain"


def test_disabled_speculation_is_reported():
    decision = decide(features("copy"), load(1), synthetic_profile(), policy(speculation={"enabled": False}))
    assert decision.backend == "plain"
    assert "speculation: disabled by the policy" in decision.reasons


def test_with_batching_disabled_the_speculative_backend_takes_everything():
    decision = decide(features("prose"), load(64), synthetic_profile(), policy(batching={"enabled": False}))
    assert (decision.backend, decision.stage) == ("speculative", "batching")


# ---- quantization: only when the config allows, the quality floor holds, and load justifies it ----


def test_quantization_at_high_load_when_allowed():
    decision = decide(features("copy"), load(32), synthetic_profile(quantized_agreement=0.97), policy())
    assert (decision.backend, decision.stage) == ("quantized", "quantization")
    assert any("concurrency 32 ≥ 16" in r and "97.0% agreement" in r for r in decision.reasons)


def test_quantization_needs_a_justifying_load_unless_faster_is_enough():
    config = policy(quantization={"when_faster": False})
    decision = decide(features("prose"), load(2), synthetic_profile(quantized_agreement=0.97), config)
    assert decision.backend == "plain"
    assert any(r.startswith("quantization: not justified") for r in decision.reasons)


def test_above_the_floor_a_faster_quantized_backend_serves_at_any_load():
    decision = decide(features("prose"), load(1), synthetic_profile(quantized_agreement=0.99), policy())
    assert (decision.backend, decision.stage) == ("quantized", "quantization")
    reason = next(r for r in decision.reasons if r.startswith("quantization"))
    assert "quality 99.0% ≥ floor 95.0%" in reason and "faster end to end" in reason


# At 64 sequences the cost model predicts speculation on 'copy' short of min_speedup (at 32, still 1.17×):
# plain is what stands before the quantization stage.
def test_quantization_is_off_when_the_config_says_so():
    config = policy(quantization={"enabled": False})
    decision = decide(features("copy"), load(64), synthetic_profile(quantized_agreement=0.97), config)
    assert decision.backend == "plain"
    assert "quantization: disabled by the policy" in decision.reasons


def test_quantization_below_the_quality_floor_is_refused():
    decision = decide(features("copy"), load(64), synthetic_profile(quantized_agreement=0.60), policy())
    assert decision.backend == "plain"
    assert any("< floor 95.0%" in r for r in decision.reasons)


def test_quantization_must_be_predicted_to_win():
    slower = synthetic_profile(quantized_agreement=0.99, quantized_speed=1.2)
    decision = decide(features("copy"), load(64), slower, policy())
    assert decision.backend == "plain"
    assert any("required" in r for r in decision.reasons if r.startswith("quantization"))


def test_memory_pressure_justifies_quantization():
    config = policy(quantization={"min_concurrency": None, "when_faster": False})
    profile = synthetic_profile(quantized_agreement=0.97)
    assert decide(features("prose"), load(2, memory=0.5), profile, config).backend == "plain"
    decision = decide(features("prose"), load(2, memory=0.9), profile, config)
    assert decision.backend == "quantized"
    assert any("memory 90% ≥ 85%" in r for r in decision.reasons)


def test_an_slo_miss_justifies_quantization_and_is_reported():
    config = policy(quantization={"min_concurrency": None, "when_faster": False}, slo={"tpot_ms": 60})
    decision = decide(features("prose"), load(2), synthetic_profile(quantized_agreement=0.97), config)
    assert decision.backend == "quantized"
    assert any("misses the TPOT SLO" in r for r in decision.reasons)
    plain = next(c for c in decision.candidates if c.backend == "plain")
    assert not plain.meets_slo


def test_without_a_quantized_measurement_quantization_is_not_considered():
    decision = decide(features("copy"), load(32), synthetic_profile(), policy())
    assert "quantization: the profile has no quantized backend measured" in decision.reasons
    assert all(c.backend != "quantized" for c in decision.candidates)


def test_the_quantized_backend_speculates_where_its_own_measured_alpha_pays():
    profile = synthetic_profile(quantized_agreement=0.99, quantized_alphas={"copy": 0.8, "prose": 0.1})
    decision = decide(features("copy"), load(1), profile, policy())
    assert (decision.backend, decision.drafter, decision.stage) == ("quantized", "ngram", "quantization")
    reason = next(r for r in decision.reasons if r.startswith("quantization"))
    assert "speculating with ngram (α̂=0.80, measured on int4-weight-only for 'copy'" in reason
    stacked = decision.chosen()
    plain_q = next(c for c in decision.candidates if c.backend == "quantized" and c.drafter is None)
    spec = max((c for c in decision.candidates if c.backend == "speculative"), key=lambda c: c.speedup)
    assert stacked.tpot_ms < plain_q.tpot_ms and stacked.tpot_ms < spec.tpot_ms
    # where its α is low, it decodes plain: the speculation policy's margin applies to it too
    prose = decide(features("prose"), load(1), profile, policy())
    assert (prose.backend, prose.drafter) == ("quantized", None)
    assert not any("speculating" in r for r in prose.reasons)


def test_the_quantized_backend_follows_the_speculation_policys_compute_bound_skip():
    profile = synthetic_profile(quantized_agreement=0.99, quantized_alphas={"copy": 0.95})
    strict = policy(bottleneck={"skip_speculation_when_compute_bound": True})
    decision = decide(features("copy", ngram=0.95), load(32), profile, strict)
    assert decision.bottleneck == "compute" and decision.drafter is None
    plain_q = next(c for c in decision.candidates if c.backend == "quantized" and c.drafter is None)
    stacked = next(c for c in decision.candidates if c.backend == "quantized" and c.drafter == "ngram")
    assert stacked.speedup >= strict.speculation.min_speedup * plain_q.speedup  # it would pay: the policy refused


def test_the_quantized_backend_speculates_only_on_acceptance_measured_on_it():
    decision = decide(features("copy"), load(1), synthetic_profile(quantized_agreement=0.99), policy())
    assert [c.drafter for c in decision.candidates if c.backend == "quantized"] == [None]
    off = policy(speculation={"enabled": False})
    profile = synthetic_profile(quantized_agreement=0.99, quantized_alphas={"copy": 0.8})
    assert decide(features("copy"), load(1), profile, off).drafter is None


def test_an_unprofiled_prompt_scales_its_predicted_alpha_by_the_measured_ratio():
    # the quantized model's prompt lookup accepts 0.9× what the target's does on the same categories
    profile = synthetic_profile(quantized_agreement=0.99, quantized_alphas={c: 0.9 * a for c, a in ALPHAS.items()})
    decision = decide(features(None, ngram=0.8), load(1), profile, policy())
    stacked = next(c for c in decision.candidates if c.backend == "quantized" and c.drafter == "ngram")
    assert stacked.alpha == pytest.approx(0.72)
    assert "× 0.90 (int4-weight-only's measured α over the target's)" in (stacked.alpha_source or "")


def test_cached_prompt_tokens_shorten_only_their_backends_predicted_ttft():
    profile = synthetic_profile()
    long = features("copy").model_copy(update={"prompt_tokens": 240})
    cold = decide(long, load(1), profile, policy())
    warm = decide(long.model_copy(update={"cached_tokens": {"plain": 224}}), load(1), profile, policy())
    by = {(c.backend, c.drafter): c for c in cold.candidates}
    for c in warm.candidates:
        before = by[(c.backend, c.drafter)]
        if c.backend == "plain":  # the prefill curve: 16 of 240 tokens left to prefill
            assert c.ttft_ms == pytest.approx(before.ttft_ms * 0.1 / (0.1 + 0.4 * 224 / 240), rel=1e-6)
            assert before.latency_ms - c.latency_ms == pytest.approx(before.ttft_ms - c.ttft_ms)
        else:
            assert (c.ttft_ms, c.latency_ms) == (before.ttft_ms, before.latency_ms)
    reason = "prefix cache: the plain backend holds about 224 of the prompt's 240"
    assert any(r.startswith(reason) for r in warm.reasons)


def test_the_last_reason_reports_the_slo():
    decision = decide(features("copy"), load(1), synthetic_profile(), policy())
    assert decision.reasons[-1].startswith("slo: predicted TTFT") and decision.reasons[-1].endswith("met")


def test_policies_import_neither_torch_nor_ray():
    code = (
        "import sys, policies.policy, policies.config, policies.profile, policies.estimates, policies.cost_model; "
        "sys.exit(bool({'torch', 'ray', 'transformers'} & set(sys.modules)))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_break_even_per_drafter_is_reported_for_capacity_planning():
    one = policy(speculation={"drafters": ["ngram"], "k_max": 1})
    decision = decide(features("copy", ngram=0.5), load(1), synthetic_profile(), one)
    # t = F + P·b·w, c ≈ 0, ρ = 1, k = 1: speedup falls below 1 just before b* = αF / (P(1 − α)) = 28.
    assert decision.break_even["ngram"] in (27, 28, 29)
    high = decide(features("copy", ngram=0.95), load(1), synthetic_profile(), one)
    assert high.break_even["ngram"] is None or high.break_even["ngram"] > decision.break_even["ngram"]
    # routing and the simulation skip it; the decision itself is the same
    quick = decide(features("copy", ngram=0.5), load(1), synthetic_profile(), one, break_even=False)
    assert quick.break_even == {} and quick.model_copy(update={"break_even": decision.break_even}) == decision


def test_rare_proposals_shrink_the_predicted_gain():
    """'sparse': α 0.9 when prompt lookup matches, but it matches in 20 % of steps: E = 1 + 0.2·(E(0.9, k) − 1),
    and steps without a match run a plain pass."""
    decision = decide(features("sparse"), load(1), synthetic_profile(), policy())
    spec = next(c for c in decision.candidates if c.backend == "speculative")
    assert spec.proposal_rate == 0.2
    assert spec.expected_tokens < 1 + 0.2 * 8
    assert any("proposes in 20% of steps" in r for r in decision.reasons)
    dense = decide(features("copy", ngram=0.9), load(1), synthetic_profile(), policy())
    assert dense.chosen().speedup > spec.speedup


def _with_lookahead(block_width: int) -> Profile:
    profile = synthetic_profile()
    lookahead = DrafterProfile(
        name="lookahead-2x3x1",
        kind="lookahead",
        batches=[1],
        step_seconds=[1e-4],
        block_width=block_width,
        block_draft=2,
    )
    measured = [acceptance(c, lookahead.name, a) for c, a in ALPHAS.items()]
    return profile.model_copy(
        update={"drafters": [*profile.drafters, lookahead], "acceptance": [*profile.acceptance, *measured]}
    )


def test_a_structured_drafter_is_costed_at_its_block_width_whatever_k_the_policy_allows():
    """Lookahead's every step runs its whole block (here 5 positions) and verifies up to 2 tokens:
    v = t(b, 5) / t(b, 1), k = 2, speedup = (1 + α + α²) / v; at high load the wide pass loses."""
    profile = _with_lookahead(5)
    config = policy(speculation={"drafters": ["lookahead"]})
    decision = decide(features("copy", **{"lookahead-2x3x1": 0.8}), load(1), profile, config)
    spec = next(c for c in decision.candidates if c.backend == "speculative")
    v = step(1, 5) / step(1, 1)
    assert (spec.drafter, spec.k) == ("lookahead-2x3x1", 2) and spec.v == pytest.approx(v, rel=1e-3)
    assert spec.speedup == pytest.approx((1 + 0.8 + 0.64) / v, rel=1e-2)
    assert decision.backend == "speculative"
    assert decision.break_even["lookahead-2x3x1"] is not None  # t grows with b·w: the block stops paying
    busy = decide(features("copy", **{"lookahead-2x3x1": 0.8}), load(64), profile, config)
    assert busy.backend != "speculative"


def test_a_structured_drafter_wider_than_the_profile_measured_is_left_out_with_a_reason():
    config = policy(speculation={"drafters": ["lookahead"]})
    decision = decide(features("copy", **{"lookahead-2x3x1": 0.8}), load(1), _with_lookahead(17), config)
    assert decision.backend != "speculative"
    assert any("runs passes of 17 positions; the profile measured up to 9" in r for r in decision.reasons)


def test_a_long_prompt_is_costed_at_its_own_context():
    """Every pass over a long context costs more, a wide one relatively less: the policy reads the
    curves at the request's decode context (prompt + half the answer), so v(b, k) falls with it."""
    from tests.policies.profiles import context_curve, with_context

    profile = synthetic_profile().model_copy(update={"context": context_curve()})
    load = LoadSnapshot(in_flight={"plain": 7})  # concurrency 8
    short = decide(RequestFeatures(prompt_tokens=64, max_tokens=128, category="copy"), load, profile, PolicyConfig())
    long = decide(RequestFeatures(prompt_tokens=1936, max_tokens=128, category="copy"), load, profile, PolicyConfig())
    plain_short, plain_long = (next(c for c in d.candidates if c.backend == "plain") for d in (short, long))
    assert plain_short.tpot_ms == pytest.approx(with_context(8, 1, 64 + 64) * 1e3)
    assert plain_long.tpot_ms == pytest.approx(with_context(8, 1, 1936 + 64) * 1e3)
    spec_short, spec_long = (
        next(c for c in d.candidates if c.backend == "speculative" and c.drafter == "ngram") for d in (short, long)
    )
    assert spec_long.v < spec_short.v or spec_long.k > spec_short.k


def test_every_decision_with_a_provisional_profile_says_so_first():
    full = synthetic_profile()
    probe = full.model_copy(update={"provisional": True})
    assert not any("provisional" in r for r in decide(features("copy"), load(1), full, policy()).reasons)
    decision = decide(features("copy"), load(4), probe, policy())
    assert decision.reasons[0] == probe.provisional_reason()
    assert decision.backend == decide(features("copy"), load(4), full, policy()).backend  # the same measurements


def test_a_provisional_profile_without_the_quantized_backend_never_routes_there():
    probe = synthetic_profile().model_copy(update={"provisional": True})
    decision = decide(features("prose"), load(64), probe, policy(quantization={"when_faster": True}))
    assert decision.backend != "quantized"
    assert (
        "quantization: the profile has no quantized backend measured yet: not routed there until the full "
        "profile measures it" in decision.reasons
    )
