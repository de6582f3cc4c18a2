import numpy as np
import pytest

from backends.speculative.control import AcceptanceTracker, DraftCosts, KChooser, StepCosts, batch_bucket


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


def test_a_measured_pass_rescales_the_whole_curve_of_its_bucket():
    costs, _ = _costs({1: 50, 2: 90, 3: 95, 4: 60, 5: 70})
    costs.record_target(3, 4, 0.120)  # a 4-token pass ran at twice its probed time
    factor = 1 + 0.2 * (2.0 - 1)
    assert costs.seconds(4, 1) == pytest.approx(0.05 * factor)
    assert costs.seconds(4, 2) == pytest.approx(0.09 * factor)
    assert costs.seconds(1, 1) == pytest.approx(0.05)  # other buckets keep their own curve
    assert costs.verify_costs(4) == pytest.approx(costs.verify_costs(1))  # the shape is the probe's


def test_verify_costs_use_the_cheapest_width_the_engine_would_pad_to():
    costs, _ = _costs({1: 50, 2: 90, 3: 95, 4: 60, 5: 70})
    assert costs.cheapest_width(1, 2) == 4  # a 2-token pass is slower than a 4-token one here
    assert costs.cheapest_width(1, 5) == 5
    assert costs.verify_costs(1) == pytest.approx([1.0, 1.2, 1.2, 1.2, 1.4])


def test_draft_cost_is_unknown_until_measured_then_relative_to_a_target_step():
    costs, _ = _costs({1: 50, 2: 60})
    drafts = DraftCosts()
    assert drafts.relative(1, costs) is None
    drafts.record(1, steps=4, seconds=0.02)
    assert drafts.relative(1, costs) == pytest.approx(0.1)
    drafts.record(1, steps=0, seconds=5.0)  # nothing drafted: no evidence
    assert drafts.relative(1, costs) == pytest.approx(0.1)


def test_acceptance_counts_the_rejected_token_as_judged():
    tracker = AcceptanceTracker(prior_alpha=0.5, prior_weight=2.0, decay=1.0)
    tracker.update(drafted=4, accepted=4)  # 4 trials, all accepted
    tracker.update(drafted=4, accepted=1)  # 2 trials: one accepted, then a rejection
    assert tracker.alpha == pytest.approx((1 + 5) / (2 + 6))
    tracker.update(drafted=0, accepted=0)  # nothing drafted: no evidence
    assert tracker.alpha == pytest.approx(6 / 8)


def test_old_evidence_decays():
    tracker = AcceptanceTracker(decay=0.5)
    for _ in range(20):
        tracker.update(4, 4)
    assert tracker.alpha > 0.85
    for _ in range(6):
        tracker.update(4, 0)
    assert tracker.alpha < 0.3  # the prior (weight 2) now outweighs what is left of the old run


@pytest.mark.parametrize("true_alpha,expect_drafting", [(0.02, False), (0.95, True)])
def test_k_chooser_learns_whether_drafting_pays(true_alpha, expect_drafting):
    costs, _ = _costs({w: 50 + 5 * (w - 1) for w in range(1, 10)})
    chooser = KChooser(8, AcceptanceTracker(), np.random.default_rng(0))
    rng = np.random.default_rng(1)
    ks = []
    for _ in range(200):
        k = chooser.choose(0.2, costs.verify_costs(1))  # c = 0.2
        accepted = int(np.cumprod(rng.random(k) < true_alpha).sum()) if k else 0
        chooser.observe(k, accepted)
        ks.append(k)
    late = ks[100:]
    if expect_drafting:
        assert np.mean(late) > 4
    else:
        assert np.mean([k > 0 for k in late]) < 0.1  # only rare exploratory drafts
