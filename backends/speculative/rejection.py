"""Exact acceptance of drafted tokens: pure tensor functions, batched.

For row b with drafts x[0..L_b-1] drawn from q and target distributions p[0..L_b] (p[j] is the
target's distribution for the token at draft position j, p[L_b] the one after the last draft):
accept x[j] with probability min(1, p(x[j]) / q(x[j])), left to right; at the first rejection
draw the replacement from norm(max(0, p[j] − q[j])); if all L_b are accepted draw a bonus token
from p[L_b]. The emitted tokens are then distributed exactly as sampling from p one token at a
time. Deterministic drafters (prompt lookup, greedy drafts) have q one-hot at x.

Every row draws only from its own generator and only as many numbers as its own drafts need,
so what a row emits never depends on the rows it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling import draw


def accept_greedy(
    drafts: torch.Tensor, lengths: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept the longest prefix equal to the target's argmax tokens.

    drafts (B, K), lengths (B,) drafts per row (≤ K), target_tokens (B, K+1) the target's argmax
    at each position. Returns (accepted (B,), next_token (B,)): the next token is the target's
    own choice right after the accepted prefix — exactly what greedy plain decoding emits.
    """
    batch, width = drafts.shape
    positions = torch.arange(width, device=drafts.device).unsqueeze(0)
    matches = (drafts == target_tokens[:, :width]) & (positions < lengths.unsqueeze(1))
    accepted = matches.long().cumprod(dim=1).sum(dim=1)
    next_token = target_tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return accepted, next_token


def accept_sampled(
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: drafts (B, K), lengths (B,), target_probs p (B, K+1, V),
    draft_probs q (B, K, V) or None for one-hot q at the drafts. Returns (accepted, next_token)."""
    batch, width = drafts.shape
    p_draft = target_probs[:, :width].gather(2, drafts.unsqueeze(2)).squeeze(2).double()
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2).double()
    uniforms = _row_uniforms(lengths, width, generators, drafts.device)
    # P(u < p/q) = min(1, p/q); written as u·q < p so q = 0 (never drawn) cannot divide by zero.
    accept = (uniforms * q_draft < p_draft) & (torch.arange(width, device=drafts.device) < lengths.unsqueeze(1))
    accepted = accept.long().cumprod(dim=1).sum(dim=1)
    final = target_probs.gather(1, accepted.view(batch, 1, 1).expand(-1, 1, target_probs.shape[2])).squeeze(1)
    rejected = accepted < lengths
    if rejected.any():
        final = final.clone()
        rows = rejected.nonzero().squeeze(1)
        final[rows] = residual(final[rows], _draft_dist_at(drafts, draft_probs, rows, accepted[rows], final.shape[1]))
    return accepted, draw(final, generators)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) per row. A row whose residual has no mass (p ≤ q everywhere, which
    only rounding can produce after a rejection) falls back to p."""
    rest = (p - q).clamp(min=0.0)
    total = rest.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, rest / total.clamp(min=torch.finfo(rest.dtype).tiny), p)


def _draft_dist_at(
    drafts: torch.Tensor, draft_probs: torch.Tensor | None, rows: torch.Tensor, positions: torch.Tensor, vocab: int
) -> torch.Tensor:
    """q at the rejected position of each given row (one-hot at the draft when q is None)."""
    if draft_probs is not None:
        return draft_probs[rows, positions].float()
    one_hot = torch.zeros((len(rows), vocab), device=drafts.device)
    return one_hot.scatter_(1, drafts[rows, positions].unsqueeze(1), 1.0)


def _row_uniforms(
    lengths: torch.Tensor, width: int, generators: Sequence[torch.Generator], device: torch.device
) -> torch.Tensor:
    """(B, K) uniforms in [0, 1); row b draws exactly lengths[b] from its own generator (the rest are 1)."""
    uniforms = torch.ones((len(generators), width), dtype=torch.float64)
    for row, (count, generator) in enumerate(zip(lengths.tolist(), generators, strict=True)):
        if count:
            uniforms[row, :count] = torch.rand(count, generator=generator, dtype=torch.float64, device=generator.device)
    return uniforms.to(device)


@dataclass(frozen=True)
class CandidateVerdict:
    """What verifying several candidate continuations of one row at once kept: `accepted` tokens of
    candidate `branch` (whose keys and values stay in the cache), then `next_token` from the target."""

    branch: int
    accepted: int
    next_token: int


def accept_candidates_greedy(candidates: Sequence[Sequence[int]], target_tokens: torch.Tensor) -> CandidateVerdict:
    """Greedy verification of several candidates of one row (lookahead's n-grams): the longest
    candidate prefix equal to the target's argmax chain, then the target's own next token — exactly
    what greedy plain decoding emits. target_tokens (G, L+1): the argmax after each candidate's
    first j tokens, j = 0..L."""
    best = CandidateVerdict(0, 0, int(target_tokens[0, 0]))
    for branch, accepted in enumerate(greedy_matches(candidates, target_tokens)):
        if accepted > best.accepted:
            best = CandidateVerdict(branch, accepted, int(target_tokens[branch, accepted]))
    return best


def greedy_matches(candidates: Sequence[Sequence[int]], target_tokens: torch.Tensor) -> list[int]:
    """Per candidate, how many of its tokens equal the target's argmax chain after it (target_tokens
    as `accept_candidates_greedy` takes them): what greedy verification would accept of each."""
    matches = []
    for branch, tokens in enumerate(candidates):
        chain = target_tokens[branch].tolist()
        matched = 0
        while matched < len(tokens) and tokens[matched] == chain[matched]:
            matched += 1
        matches.append(matched)
    return matches


def accept_candidates_sampled(
    candidates: Sequence[Sequence[int]], target_probs: torch.Tensor, generator: torch.Generator
) -> CandidateVerdict:
    """Speculative sampling over several deterministic candidates of one row (SpecInfer's rule for
    one-hot drafts, what lookahead decoding needs): at each depth the distinct next tokens of the
    candidates still matching the accepted prefix are tried in turn; token c is accepted with
    probability p(c) under the current p, and on rejection p becomes norm(p with c zeroed) — the
    residual norm(max(0, p − q)) of a one-hot q. When every one is rejected the next token is drawn
    from what is left; when a candidate is accepted to its end, from the target after it. Each
    emitted token is thereby distributed exactly as the target's, whatever the candidates.
    target_probs (G, L+1, V): the target's distribution after each candidate's first j tokens
    (candidates sharing a prefix share it; the first one's is used)."""
    if not any(candidates):
        return CandidateVerdict(0, 0, int(draw(target_probs[0, 0].double().unsqueeze(0), [generator])[0]))
    alive = [b for b, tokens in enumerate(candidates) if tokens]
    depth = 0
    while True:
        p = target_probs[alive[0], depth].double()
        tried: list[int] = []
        for branch in alive:
            tokens = candidates[branch]
            if depth < len(tokens) and tokens[depth] not in tried:
                tried.append(tokens[depth])
        accepted_token = None
        for token in tried:
            u = torch.rand((), generator=generator, dtype=torch.float64, device=generator.device)
            if u * p.sum() < p[token]:  # P = p(c) / Σp: p is renormalised lazily
                accepted_token = token
                break
            p = p.clone()
            p[token] = 0.0
        if accepted_token is None:
            rest = p if p.sum() > 0 else target_probs[alive[0], depth].double()  # rounding only
            return CandidateVerdict(alive[0], depth, int(draw(rest.unsqueeze(0), [generator])[0]))
        alive = [b for b in alive if depth < len(candidates[b]) and candidates[b][depth] == accepted_token]
        depth += 1
        if depth == max(len(candidates[b]) for b in alive):
            longest = next(b for b in alive if len(candidates[b]) == depth)
            after = target_probs[longest, depth].double()
            return CandidateVerdict(longest, depth, int(draw(after.unsqueeze(0), [generator])[0]))
        alive = [b for b in alive if len(candidates[b]) > depth]


def candidate_chains(per_position: torch.Tensor, branches: list[list[int]]) -> torch.Tensor:
    """(G, L + 1, …): what the target gave at the root and after each of a branch's tokens
    (argmax (T,) or distributions (T, V)), zero past a shorter branch's end."""
    if not branches:
        return per_position[:1].unsqueeze(0)
    longest = max(len(b) for b in branches)
    chains = per_position.new_zeros((len(branches), longest + 1, *per_position.shape[1:]))
    for g, branch in enumerate(branches):
        chains[g, : len(branch) + 1] = per_position[[0, *branch]]
    return chains
