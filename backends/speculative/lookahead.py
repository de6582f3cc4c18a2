"""Lookahead decoding's parts (Fu et al., "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding", 2024): a Jacobi window whose trajectories yield n-grams, a pool of them, and
the one structured block that runs the window and verifies the pool's candidates in one target pass.

The window holds N − 1 levels of W guessed tokens. Level l, column i stands at position root + 1 +
i + l and sees the root, level 0's columns up to i and its own column's levels below it — so each
column reads as a run of consecutive guesses, and the target's prediction after the top of column
i completes an n-gram: the column's N − 1 tokens and that prediction. The window then drops its
oldest level and the predictions become its newest (a Jacobi step). The pool keeps the n-grams by
first token; those starting with the root are the candidates the same pass verifies, each a branch
that sees only the root and itself. Nothing here decides what is emitted: verification is
`rejection.accept_candidates_*`, exact whatever the window guessed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kv import BlockStructure, PagedCache
from .rejection import accept_candidates_greedy


class NgramPool:
    """N-grams harvested from the window, by first token: each key keeps its `per_key` most
    recent distinct continuations (N − 1 tokens), newest first."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self._by_first: dict[int, list[tuple[int, ...]]] = {}

    def add(self, ngram: Sequence[int]) -> None:
        first, rest = ngram[0], tuple(ngram[1:])
        kept = self._by_first.setdefault(first, [])
        if rest in kept:
            kept.remove(rest)
        kept.insert(0, rest)
        del kept[self.per_key :]

    def candidates(self, token: int, limit: int) -> list[list[int]]:
        return [list(rest) for rest in self._by_first.get(token, [])[:limit]]

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._by_first.values())


class JacobiWindow:
    """N − 1 levels × W columns of guesses, started from tokens of the prompt (`seed_tokens`)."""

    def __init__(self, window: int, ngram: int, seed_tokens: Sequence[int], rng: random.Random):
        if window < 1 or ngram < 2:
            raise ValueError(f"a lookahead window needs W ≥ 1 and N ≥ 2 (got W={window}, N={ngram})")
        if not seed_tokens:
            raise ValueError("a lookahead window is seeded from the prompt's tokens: the prompt is empty")
        self.window, self.ngram = window, ngram
        self.levels = [[rng.choice(seed_tokens) for _ in range(window)] for _ in range(ngram - 1)]

    @property
    def size(self) -> int:
        return self.window * (self.ngram - 1)

    def tokens(self) -> list[int]:
        """Level-major: level 0's columns, then level 1's, …"""
        return [token for level in self.levels for token in level]

    def index(self, level: int, column: int) -> int:
        return level * self.window + column

    def advance(self, predictions: Sequence[int]) -> list[list[int]]:
        """One Jacobi step from the target's predictions after the top level's columns: the
        n-grams completed (one per column), then the window shifted by a level."""
        ngrams = [[level[i] for level in self.levels] + [int(predictions[i])] for i in range(self.window)]
        self.levels = [*self.levels[1:], [int(t) for t in predictions]]
        return ngrams


@dataclass(frozen=True)
class LookaheadBlock:
    """One pass's block for a row: the root, the candidates' branches, then the window."""

    tokens: list[int]
    structure: BlockStructure
    branches: list[list[int]]  # block indices of each candidate's tokens (the root is index 0)
    top_level: list[int]  # block indices of the window's top level, column by column


def lookahead_block(root: int, candidates: Sequence[Sequence[int]], window: JacobiWindow) -> LookaheadBlock:
    """The structured block verifying `candidates` (continuations of `root`) and running `window`."""
    tokens, offsets, branches = [root], [0], []
    for candidate in candidates:
        branches.append(list(range(len(tokens), len(tokens) + len(candidate))))
        tokens += list(candidate)
        offsets += list(range(1, len(candidate) + 1))
    base = len(tokens)
    tokens += window.tokens()
    offsets += [1 + i + level for level in range(window.ngram - 1) for i in range(window.window)]
    sees = torch.eye(len(tokens), dtype=torch.bool)
    sees[:, 0] = True  # everything continues the root
    for branch in branches:
        for depth, at in enumerate(branch):
            sees[at, branch[:depth]] = True
    for level in range(window.ngram - 1):
        for column in range(window.window):
            at = base + window.index(level, column)
            sees[at, [base + window.index(0, j) for j in range(column + 1)]] = True
            sees[at, [base + window.index(lower, column) for lower in range(1, level)]] = True
    top = [base + window.index(window.ngram - 2, i) for i in range(window.window)]
    return LookaheadBlock(tokens, BlockStructure(torch.tensor(offsets), sees), branches, top)


@dataclass
class LookaheadRun:
    """What a lookahead decode emitted and how: target passes and tokens accepted from candidates."""

    tokens: list[int]
    passes: int = 0
    accepted: int = 0
    pass_width: int = 0  # the widest pass


@torch.inference_mode()
def lookahead_greedy(
    cache: PagedCache, prompt: Sequence[int], max_tokens: int, window: int, ngram: int, guesses: int, seed: int = 0
) -> LookaheadRun:
    """Greedy decoding of one sequence by lookahead: every step one structured pass verifies the
    pool's candidates for the last token and advances the Jacobi window; the output is the target's
    greedy continuation token for token (`accept_candidates_greedy`), `max_tokens` of it."""
    seq = cache.add()
    try:
        run = LookaheadRun([int(cache.last_logits([seq], [list(prompt)])[0].argmax())], passes=1)
        jacobi, pool = JacobiWindow(window, ngram, prompt, random.Random(seed)), NgramPool(guesses)
        while len(run.tokens) < max_tokens:
            root = run.tokens[-1]
            candidates = pool.candidates(root, guesses)
            block = lookahead_block(root, candidates, jacobi)
            start = cache.length(seq)
            argmax = cache.logits([seq], [block.tokens], structures=[block.structure])[0].argmax(dim=-1)
            verdict = accept_candidates_greedy(candidates, _chains(argmax, block.branches))
            kept = block.branches[verdict.branch][: verdict.accepted] if candidates else []
            cache.keep_branch(seq, start, [0, *kept])
            for completed in jacobi.advance(argmax[block.top_level].tolist()):
                pool.add(completed)
            accepted = candidates[verdict.branch][: verdict.accepted] if candidates else []
            run.tokens += [*accepted, verdict.next_token]
            run.passes += 1
            run.accepted += len(accepted)
            run.pass_width = max(run.pass_width, len(block.tokens))
    finally:
        cache.remove(seq)
    del run.tokens[max_tokens:]
    return run


def _chains(argmax: torch.Tensor, branches: list[list[int]]) -> torch.Tensor:
    """(G, L + 1): the target's argmax after the root and after each of a branch's tokens."""
    if not branches:
        return argmax[:1].unsqueeze(0)
    longest = max(len(b) for b in branches)
    chains = torch.zeros((len(branches), longest + 1), dtype=torch.long)
    for g, branch in enumerate(branches):
        chains[g, : len(branch) + 1] = argmax[[0, *branch]]
    return chains
