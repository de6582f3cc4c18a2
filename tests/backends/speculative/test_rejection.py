"""The acceptance rule is lossless: emitted tokens follow the target distribution p exactly,
checked with a χ² goodness-of-fit test (and shown to catch a biased rule)."""

import pytest
import torch
from scipy.stats import chisquare

from backends.sampling import SamplingParams, target_probs
from backends.speculative.rejection import (
    CandidateVerdict,
    accept_candidates_greedy,
    accept_candidates_sampled,
    accept_greedy,
    accept_sampled,
    residual,
)

VOCAB = 12
DRAWS = 20_000


def _chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the observed token counts against probs; bins expecting < 5 are merged."""
    assert len(tokens) >= 500, "too few samples for a meaningful test"
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    assert observed[expected == 0].sum() == 0, "a zero-probability token was emitted"
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    return float(
        chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item() / exp[keep].sum().item()).pvalue
    )


def _setup(params: SamplingParams, k: int, seed: int, one_hot_q: bool):
    """DRAWS copies of one step: random target/draft logits → p (k+1 positions), q (k), drafts x ~ q."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, k + 1, VOCAB, generator=g) * 2
    p = target_probs(logits, [params])[0]
    # A drafter that roughly agrees with the target: its logits are the target's plus noise.
    q = target_probs(logits[:, :k] + torch.randn(1, k, VOCAB, generator=g), [params])[0]
    rows = DRAWS
    drafts = torch.multinomial(q, rows, replacement=True, generator=g).T  # (rows, k)
    if one_hot_q:  # a deterministic drafter: fixed drafts (p's favourites, so many get accepted)
        drafts = p[:k].argmax(dim=-1).expand(rows, k).contiguous()
    generators = [torch.Generator().manual_seed(seed * 100_000 + i) for i in range(rows)]
    lengths = torch.full((rows,), k)
    q_rows = None if one_hot_q else q.expand(rows, k, VOCAB)
    return p, drafts, lengths, q_rows, generators


CASES = [
    (SamplingParams(temperature=1.0), 1),
    (SamplingParams(temperature=0.7), 3),
    (SamplingParams(temperature=1.5, top_p=0.8), 2),
    (SamplingParams(temperature=1.0, top_k=5), 3),
]


@pytest.mark.parametrize("one_hot_q", [False, True], ids=["sampled-q", "one-hot-q"])
@pytest.mark.parametrize("params,k", CASES)
def test_first_two_emitted_tokens_follow_p(params, k, one_hot_q):
    p, drafts, lengths, q, generators = _setup(params, k, seed=3 + k, one_hot_q=one_hot_q)
    accepted, next_token = accept_sampled(drafts, lengths, p.expand(DRAWS, -1, -1), q, generators)
    first = torch.where(accepted > 0, drafts[:, 0], next_token)
    assert _chi2_pvalue(first, p[0]) > 1e-3
    # The second token exists when the first draft was accepted; it must then follow p[1].
    rows = accepted > 0
    second = torch.where(accepted[rows] > 1, drafts[rows, min(1, k - 1)], next_token[rows])
    assert _chi2_pvalue(second, p[1]) > 1e-3


def test_the_chi_square_check_catches_a_biased_rule():
    """Accepting every draft emits q, not p: the same test must reject it."""
    p, drafts, lengths, q, generators = _setup(SamplingParams(temperature=1.0), 2, seed=11, one_hot_q=False)
    assert _chi2_pvalue(drafts[:, 0], p[0]) < 1e-6


def test_mean_accepted_length_with_sampled_drafts_matches_the_theory():
    """With x ~ q, the chance to accept is Σ min(p, q): a known closed form."""
    params = SamplingParams(temperature=1.0)
    p, drafts, lengths, q, generators = _setup(params, 1, seed=5, one_hot_q=False)
    accepted, _ = accept_sampled(drafts, lengths, p.expand(DRAWS, -1, -1), q, generators)
    alpha = torch.minimum(p[0], q[0, 0]).sum().item()
    standard_error = (alpha * (1 - alpha) / DRAWS) ** 0.5
    assert abs(accepted.double().mean().item() - alpha) < 4 * standard_error


def test_rows_draw_only_their_own_randomness():
    """A row's result depends on its generator and its drafts only, not on its batch-mates."""
    p, drafts, lengths, q, _ = _setup(SamplingParams(temperature=1.0), 3, seed=2, one_hot_q=False)
    batch = [torch.Generator().manual_seed(42), torch.Generator().manual_seed(43)]
    together = accept_sampled(drafts[:2], torch.tensor([3, 1]), p.expand(2, -1, -1), q[:2], batch)
    alone = accept_sampled(
        drafts[:1], torch.tensor([3]), p.expand(1, -1, -1), q[:1], [torch.Generator().manual_seed(42)]
    )
    assert together[0][0] == alone[0][0] and together[1][0] == alone[1][0]


def test_greedy_accepts_the_prefix_matching_the_argmax_and_emits_the_argmax_after_it():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 9], [5, 6, 7], [1, 2, 3]])
    accepted, next_token = accept_greedy(drafts, torch.tensor([3, 3, 1]), target)
    assert accepted.tolist() == [2, 3, 1]
    assert next_token.tolist() == [7, 8, 2]


def test_greedy_probabilities_reduce_to_the_argmax_rule():
    """One-hot p through the sampled rule gives the greedy answer, whatever the generator."""
    target = torch.tensor([[3, 1, 4]])
    p = torch.nn.functional.one_hot(target, VOCAB).float()
    drafts = torch.tensor([[3, 2]])
    accepted, next_token = accept_sampled(drafts, torch.tensor([2]), p, None, [torch.Generator().manual_seed(0)])
    assert accepted.item() == 1 and next_token.item() == 1


def test_zero_drafts_is_a_plain_draw_from_p():
    p = target_probs(torch.randn(1, 1, VOCAB), [SamplingParams(temperature=1.0)])
    rows = 5000
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    empty = torch.zeros((rows, 0), dtype=torch.long)
    accepted, tokens = accept_sampled(
        empty, torch.zeros(rows, dtype=torch.long), p.expand(rows, -1, -1), None, generators
    )
    assert accepted.sum() == 0
    assert _chi2_pvalue(tokens, p[0, 0]) > 1e-3


def test_residual_is_normalised_and_falls_back_to_p_when_empty():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.1, 0.3, 0.6], [0.2, 0.3, 0.5]])
    out = residual(p, q)
    assert torch.allclose(out[0], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(out[1], p[1])


# Several candidates verified at once (lookahead's n-grams): a small tree of true conditionals.
TREE_VOCAB = 6


def _tree(seed: int, temperature: float):
    """p(x1), p(x2 | x1) and p(x3 | x1, x2) over TREE_VOCAB tokens, from random logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1 + TREE_VOCAB + TREE_VOCAB**2, TREE_VOCAB, generator=g) * 2
    probs = torch.softmax(logits / temperature, dim=-1)
    root, second, third = probs[0], probs[1 : 1 + TREE_VOCAB], probs[1 + TREE_VOCAB :].view(TREE_VOCAB, TREE_VOCAB, -1)
    return root, second, third


def _candidate_probs(candidates, root, second, third) -> torch.Tensor:
    """(G, 3, V): the target's distribution after each candidate's first 0, 1, 2 tokens."""
    rows = []
    for tokens in candidates:
        padded = list(tokens) + [0] * (2 - len(tokens))
        rows.append(torch.stack([root, second[padded[0]], third[padded[0], padded[1]]]))
    return torch.stack(rows)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_several_candidates_at_once_keep_the_targets_joint_distribution(temperature):
    root, second, third = _tree(seed=11, temperature=temperature)
    favourite = int(root.argmax())
    unlikely = int(root.argmin())
    candidates = [
        [favourite, int(second[favourite].argmax())],
        [favourite, int(second[favourite].argmin())],  # shares its first token with the one above
        [unlikely, 0],
        [favourite, int(second[favourite].argmax())],  # a duplicate: tried once
        [int(root.argsort()[-2])],  # shorter
    ]
    probs = _candidate_probs(candidates, root, second, third)
    generator = torch.Generator().manual_seed(5)
    pairs, accepted_total = [], 0
    for _ in range(DRAWS):
        verdict = accept_candidates_sampled(candidates, probs, generator)
        emitted = candidates[verdict.branch][: verdict.accepted] + [verdict.next_token]
        accepted_total += verdict.accepted
        if len(emitted) < 2:  # the rest of the sequence from the target, as the next step would
            emitted.append(int(torch.multinomial(second[emitted[0]], 1, generator=generator)))
        pairs.append(emitted[0] * TREE_VOCAB + emitted[1])
    joint = (root.unsqueeze(1) * second).flatten()
    assert _chi2_pvalue(torch.tensor(pairs), joint) > 0.01
    assert accepted_total > DRAWS * 0.5  # the candidates were used, not just bypassed


def test_the_candidate_check_catches_a_rule_that_skips_the_residual():
    root, second, third = _tree(seed=11, temperature=1.0)
    favourite = int(root.argmax())
    candidates = [[favourite], [int(root.argsort()[-2])]]
    probs = _candidate_probs(candidates, root, second, third)
    generator = torch.Generator().manual_seed(6)
    firsts = []
    for _ in range(DRAWS):
        # Biased: after a rejection, draw from p itself instead of p with the rejected tokens zeroed.
        verdict = accept_candidates_sampled(candidates, probs, generator)
        first = (
            candidates[verdict.branch][0] if verdict.accepted else int(torch.multinomial(root, 1, generator=generator))
        )
        firsts.append(first)
    assert _chi2_pvalue(torch.tensor(firsts), root) < 1e-6


def test_greedy_candidates_keep_the_longest_prefix_on_the_argmax_chain():
    candidates = [[3, 1, 4], [3, 1, 5], [2], []]
    chains = torch.tensor([[3, 1, 5, 9], [3, 1, 5, 8], [3, 7, 7, 7], [3, 0, 0, 0]])
    verdict = accept_candidates_greedy(candidates, chains)
    assert verdict == CandidateVerdict(branch=1, accepted=3, next_token=8)
    assert accept_candidates_greedy([[2], [4]], torch.tensor([[3, 0], [3, 0]])) == CandidateVerdict(0, 0, 3)
    assert accept_candidates_greedy([], torch.tensor([[6]])) == CandidateVerdict(0, 0, 6)


def test_no_candidates_is_a_plain_draw_from_the_target():
    root, _, _ = _tree(seed=2, temperature=1.0)
    generator = torch.Generator().manual_seed(1)
    firsts = [accept_candidates_sampled([[]], root.view(1, 1, -1), generator).next_token for _ in range(5000)]
    assert _chi2_pvalue(torch.tensor(firsts), root) > 0.01
