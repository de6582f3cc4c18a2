import pytest

from backends.speculative.control import DraftCosts, DraftOutlook, RateEstimate, StepCosts, batch_bucket


def _costs(widths_ms: dict[int, float]) -> tuple[StepCosts, list[tuple[int, list[int]]]]:
    calls: list[tuple[int, list[int]]] = []

    def probe(batch, widths):
        calls.append((batch, list(widths)))
        return {w: widths_ms[w] / 1e3 for w in widths}

    return StepCosts(probe, max_width=max(widths_ms)), calls


def test_batches_are_measured_at_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 9, 64)] == [1, 2, 4, 4, 8, 16, 64]


def test_step_costs_probe_every_bucket_a_batch_can_shrink_through_once():
    costs, calls = _costs({1: 50, 2: 90, 3: 95, 4: 60, 5: 70})
    assert costs.seconds(3, 1) == pytest.approx(0.05)
    assert calls == [(4, [1, 2, 3, 4, 5]), (2, [1, 2, 3, 4, 5]), (1, [1, 2, 3, 4, 5])]
    costs.seconds(4, 5)
    costs.ensure(2)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="outside"):
        costs.seconds(1, 6)


def test_widths_a_seeded_table_lacks_are_probed_and_only_those():
    costs, calls = _costs({1: 50, 2: 90, 3: 95, 4: 60, 5: 70})
    costs.target_s.update({(1, 1): 0.04, (1, 2): 0.08, (1, 3): 0.09})  # a profile's curve up to width 3
    assert costs.seconds(1, 5) == pytest.approx(0.07) and costs.seconds(1, 1) == pytest.approx(0.04)
    assert calls == [(1, [4, 5])]


def test_a_measured_pass_rescales_the_whole_curve_of_its_bucket():
    costs, _ = _costs({1: 50, 2: 90, 3: 95, 4: 60, 5: 70})
    costs.record_target(3, 4, 0.120)  # a 4-token pass ran at twice its probed time
    factor = 1 + 0.2 * (2.0 - 1)
    assert costs.seconds(4, 1) == pytest.approx(0.05 * factor)
    assert costs.seconds(4, 2) == pytest.approx(0.09 * factor)
    assert costs.seconds(1, 1) == pytest.approx(0.05)  # other buckets keep their own curve
    shape = [costs.seconds(4, w) / costs.seconds(4, 1) for w in range(1, 6)]
    assert shape == pytest.approx([costs.seconds(1, w) / costs.seconds(1, 1) for w in range(1, 6)])  # the probe's


def test_a_verify_block_is_padded_to_the_cheapest_pass_at_least_as_wide():
    costs, _ = _costs({1: 50, 2: 90, 3: 95, 4: 60, 5: 70})
    assert costs.cheapest_width(1, 2) == 4  # a 2-token pass is slower than a 4-token one here
    assert costs.cheapest_width(1, 1) == 1
    assert costs.cheapest_width(1, 5) == 5


def test_draft_step_cost_is_unknown_until_measured_then_a_moving_average_per_bucket():
    drafts = DraftCosts()
    assert drafts.step_s == {}
    drafts.record(1, steps=4, seconds=0.02)
    assert drafts.step_s == {1: pytest.approx(0.005)}
    drafts.record(1, steps=0, seconds=5.0)  # nothing drafted: no evidence
    drafts.record(3, steps=2, seconds=0.02)
    assert drafts.step_s == {1: pytest.approx(0.005), 4: pytest.approx(0.01)}
    drafts.record(1, steps=1, seconds=0.015)
    assert drafts.step_s[1] == pytest.approx(0.8 * 0.005 + 0.2 * 0.015)


def test_catching_up_is_timed_apart_from_the_steady_draft_step():
    drafts = DraftCosts(smoothing=1.0)
    drafts.record(4, steps=3, seconds=0.030)  # steady: 10 ms a step
    drafts.record(4, steps=3, seconds=0.130, backlog=200)  # the same 3 steps after reading 200 new tokens
    assert drafts.step_s[4] == pytest.approx(0.010)  # the steady time is not spoilt by the catch-up
    assert drafts.catch_up_token_s == pytest.approx(0.100 / 200)
    assert drafts.catch_up_s(50) == pytest.approx(0.025)
    first = DraftCosts()
    first.record(2, steps=2, seconds=0.5, backlog=100)  # nothing steady known yet: the call times the step
    assert first.step_s[2] == pytest.approx(0.25) and first.catch_up_token_s == 0.0


def test_the_first_steady_call_replaces_a_step_time_known_only_from_catching_up():
    """A bucket first seen in a catch-up call (a row joining: its prompt read into the drafter's
    cache) holds an overestimate; averaging it in would spoil short runs, so it is replaced."""
    drafts = DraftCosts()
    drafts.record(16, steps=8, seconds=4.0, backlog=1400)
    assert drafts.step_s[16] == pytest.approx(0.5) and drafts.provisional == {16}
    drafts.record(16, steps=8, seconds=0.4)
    assert drafts.step_s[16] == pytest.approx(0.05) and not drafts.provisional
    drafts.record(16, steps=8, seconds=0.8)  # from now on, the moving average
    assert drafts.step_s[16] == pytest.approx(0.8 * 0.05 + 0.2 * 0.1)
    drafts.record(16, steps=8, seconds=4.0, backlog=1400)
    assert drafts.step_s[16] == pytest.approx(0.06) and drafts.catch_up_token_s > 0


def test_acceptance_counts_the_rejected_token_as_judged():
    outlook = DraftOutlook(RateEstimate(prior_mean=0.5, prior_weight=2.0, decay=1.0))
    outlook.observe(asked=4, drafted=4, accepted=4)  # 4 trials, all accepted
    outlook.observe(asked=4, drafted=4, accepted=1)  # 2 trials: one accepted, then a rejection
    assert outlook.alpha.mean == pytest.approx((1 + 5) / (2 + 6))
    outlook.observe(asked=0, drafted=0, accepted=0)  # nothing asked: no evidence
    assert outlook.alpha.mean == pytest.approx(6 / 8)


def test_a_step_without_a_proposal_lowers_the_proposal_rate_and_not_alpha():
    outlook = DraftOutlook(RateEstimate(decay=1.0), RateEstimate(prior_mean=0.5, prior_weight=2.0, decay=1.0))
    outlook.observe(asked=4, drafted=0, accepted=0)
    outlook.observe(asked=4, drafted=2, accepted=2)  # a short proposal: its missing token counts as judged
    assert outlook.proposal.mean == pytest.approx((1 + 1) / (2 + 2))
    assert outlook.alpha.mean == pytest.approx((1 + 2) / (2 + 3))


def test_old_evidence_decays():
    rate = RateEstimate(decay=0.5)
    for _ in range(20):
        rate.add(4, 4)
    assert rate.mean > 0.85
    for _ in range(6):
        rate.add(0, 4)
    assert rate.mean < 0.3  # the prior (weight 2) now outweighs what is left of the old run


def test_a_new_sequence_starts_from_what_its_drafter_showed():
    drafter = DraftOutlook(RateEstimate(decay=1.0), RateEstimate(decay=1.0))
    for _ in range(50):
        drafter.observe(asked=4, drafted=4, accepted=2)
    seeded = drafter.seeded(weight=4.0)
    assert seeded.alpha.mean == pytest.approx(drafter.alpha.mean)
    assert seeded.alpha.prior_weight == 4.0 and seeded.alpha.trials == 0


def test_with_a_context_scale_the_table_is_read_at_the_rows_context():
    """A profile's context curve: the table holds passes at its reference context; probes (run at a
    short context) are brought to it, reads and real passes are scaled from the rows' context."""

    def scale(batch, width, context):  # a pass over n cached tokens: 1 + n/1000 of one over none
        return 1.0 + context / 1000

    costs = StepCosts(
        lambda batch, widths: {w: 0.01 * w * scale(batch, w, 64) for w in widths},
        max_width=3,
        context_scale=scale,
        table_context=200,
        probe_context=64,
    )
    assert costs.seconds(1, 2) == pytest.approx(0.02 * 1.2)  # the table's context
    assert costs.seconds(1, 2, 1000) == pytest.approx(0.02 * 2.0)
    assert costs.cheapest_width(1, 2, 1000) == 2
    costs.record_target(1, 1, 0.01 * 2.0, context=1000)  # exactly as predicted there: the level stays
    assert costs.seconds(1, 1, 0) == pytest.approx(0.01)
    costs.record_target(1, 1, 0.01 * 2.0 * 2, context=1000)  # twice as slow: the level moves by the smoothing
    assert costs.seconds(1, 1, 0) == pytest.approx(0.01 * (1 + costs.smoothing))
