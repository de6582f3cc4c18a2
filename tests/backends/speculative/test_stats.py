import pytest

from backends.speculative.stats import SpeculationStats


def test_alpha_counts_short_proposals_as_rejected_and_no_proposal_in_the_proposal_rate():
    stats = SpeculationStats(drafter="ngram", k_mode="4")
    # Three rows asked for 4: all accepted; 1 of 2 proposed accepted; nothing proposed. A fourth row
    # asked for nothing (k = 0).
    stats.record(4, [4, 2, 0, 0], [4, 1, 0, 0], 0.0, 0.1, requested=[4, 4, 4, 0])
    assert stats.requested_steps == 3 and stats.drafts == 2
    assert stats.judged_tokens == 4 + (1 + 1)
    assert stats.alpha == pytest.approx(5 / 6)
    assert stats.acceptance_rate == pytest.approx(5 / 6)  # accepted / drafted
    assert stats.proposal_rate == pytest.approx(2 / 3)
    assert stats.tokens_per_step == pytest.approx(1 + 5 / 3)
    assert stats.mean_accepted_length == pytest.approx(1 + 5 / 2)  # per step with a proposal (vLLM)


def test_requested_defaults_to_k_and_combined_adds_up():
    a, b = SpeculationStats(drafter="d", k_mode="2"), SpeculationStats(drafter="d", k_mode="2")
    a.record(2, [2], [2], 0.0, 0.1)
    b.record(2, [2], [0], 0.0, 0.1)
    b.record(2, [0], [0], 0.0, 0.1)
    total = SpeculationStats.combined([a, b])
    assert (total.requested_steps, total.judged_tokens, total.accepted_tokens) == (3, 3, 2)
    assert total.alpha == pytest.approx(2 / 3) and total.proposal_rate == pytest.approx(2 / 3)
