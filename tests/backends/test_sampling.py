import pytest
import torch
from pydantic import ValidationError
from scipy.stats import chisquare

from backends.sampling import SamplingParams, draw, new_generator, sample_tokens, target_probs

VOCAB = 50


def _logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_distribution_is_one_hot_at_argmax():
    logits = _logits()
    probs = target_probs(logits, [SamplingParams()] * 4)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(4))
    assert int((probs > 0).sum()) == 4


def test_temperature_one_without_filters_is_plain_softmax():
    logits = _logits()
    probs = target_probs(logits, [SamplingParams(temperature=1.0)] * 4)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_top_k_keeps_exactly_the_k_most_likely_tokens():
    logits = _logits()
    probs = target_probs(logits, [SamplingParams(temperature=1.0, top_k=5)] * 4)
    for row in range(4):
        support = set((probs[row] > 0).nonzero().squeeze(1).tolist())
        assert support == set(logits[row].topk(5).indices.tolist())
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = _logits()
    full = torch.softmax(logits, -1)
    probs = target_probs(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * 4)
    for row in range(4):
        order = full[row].argsort(descending=True)
        mass = full[row][order].cumsum(0)
        needed = int((mass < 0.7).sum()) + 1  # tokens until the cumulative mass reaches 0.7
        assert set((probs[row] > 0).nonzero().squeeze(1).tolist()) == set(order[:needed].tolist())


def test_rows_use_their_own_settings():
    logits = _logits(rows=3)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=2.0)]
    probs = target_probs(logits, params)
    assert int((probs[0] > 0).sum()) == 1
    assert int((probs[1] > 0).sum()) == 3
    torch.testing.assert_close(probs[2], torch.softmax(logits[2] / 2.0, -1))


def test_three_dimensional_logits_apply_each_rows_settings_at_every_position():
    logits = torch.randn(2, 3, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    probs = target_probs(logits, params)
    assert probs.shape == (2, 3, VOCAB)
    assert torch.equal(probs[0].argmax(-1), logits[0].argmax(-1))
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))


def _allowed_by_definition(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """The top-k then top-p set, computed straight from the definitions in float64."""
    order = logits.double().argsort(descending=True)
    if params.top_k:
        order = order[: params.top_k]
    probs = torch.softmax(logits.double()[order] / params.temperature, -1)
    needed = int((probs.cumsum(0) < params.top_p).sum()) + 1 if params.top_p < 1 else len(order)
    return set(order[:needed].tolist())


def test_filtered_sampling_never_emits_a_token_outside_the_allowed_set():
    params = [
        SamplingParams(temperature=1.5, top_k=4),
        SamplingParams(temperature=2.0, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.6),
        SamplingParams(temperature=1.0),
    ]
    logits = _logits(rows=len(params))
    allowed = [_allowed_by_definition(logits[row], p) for row, p in enumerate(params)]
    assert all(1 < len(a) for a in allowed) and len(allowed[3]) == VOCAB
    generators = [new_generator(seed)[0] for seed in range(len(params))]
    drawn = [set() for _ in params]
    for _ in range(1500):
        for row, token in enumerate(sample_tokens(logits, params, generators).tolist()):
            drawn[row].add(token)
    for row in range(len(params)):
        assert drawn[row] <= allowed[row]
        assert len(drawn[row]) > 1


def test_a_rows_distribution_does_not_depend_on_its_batch_neighbours():
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(1))
    unfiltered = SamplingParams(temperature=1.0)
    alone = target_probs(logits[:1], [unfiltered])
    beside_filtered = target_probs(logits, [unfiltered, SamplingParams(temperature=1.0, top_p=0.5)])
    assert int((beside_filtered[0] > 0).sum()) == 49152
    torch.testing.assert_close(beside_filtered[0], alone[0])


def test_a_vanishing_temperature_tends_to_greedy_without_nan():
    logits = _logits(rows=2)
    probs = target_probs(logits, [SamplingParams(temperature=1e-45)] * 2)
    assert not probs.isnan().any()
    generator, _ = new_generator(0)
    tokens = sample_tokens(logits, [SamplingParams(temperature=1e-45)] * 2, [generator, generator])
    assert torch.equal(tokens, logits.argmax(-1))


def test_draw_matches_the_distribution_chi_square():
    probs = torch.softmax(torch.randn(1, 12, generator=torch.Generator().manual_seed(3)), -1)
    generator, _ = new_generator(11)
    samples = 20000
    counts = torch.bincount(torch.cat([draw(probs, [generator]) for _ in range(samples)]), minlength=12)
    expected = probs[0].double().numpy()
    result = chisquare(counts.numpy(), expected / expected.sum() * samples)
    assert result.pvalue > 1e-3, result


def test_draw_never_picks_a_zero_probability_token():
    probs = torch.zeros(1, VOCAB)
    probs[0, [3, 17]] = torch.tensor([0.25, 0.75])
    generator, _ = new_generator(5)
    assert {int(draw(probs, [generator])) for _ in range(500)} == {3, 17}


def test_same_seed_reproduces_and_different_seeds_differ():
    logits = _logits(rows=1)
    params = [SamplingParams(temperature=1.0)]

    def sequence(seed: int) -> list[int]:
        generator, _ = new_generator(seed)
        return [int(sample_tokens(logits, params, [generator])) for _ in range(30)]

    assert sequence(42) == sequence(42)
    assert sequence(42) != sequence(43)


def test_unseeded_generators_get_fresh_seeds():
    assert new_generator(None)[1] != new_generator(None)[1]
    assert new_generator(9)[1] == 9


@pytest.mark.parametrize(
    ("field", "value", "hint"),
    [
        ("temperature", -0.1, "greater than or equal to 0"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_k", -1, "greater than or equal to 0"),
        ("seed", -3, "greater than or equal to 0"),
        ("seed", 2**64, "less than or equal to 9223372036854775807"),
        ("temperature", float("inf"), "finite number"),
    ],
)
def test_bad_sampling_settings_name_the_field_and_the_bound(field, value, hint):
    with pytest.raises(ValidationError) as error:
        SamplingParams(**{field: value})
    assert field in str(error.value) and hint in str(error.value)
