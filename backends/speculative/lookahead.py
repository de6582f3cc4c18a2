"""Lookahead decoding's parts (Fu et al., "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding", 2024): a Jacobi window whose trajectories yield n-grams, a pool of them, and
the one structured block that runs the window and verifies the pool's candidates in one target pass,
and the drafter the step loop serves it as.

The window holds N − 1 levels of W guessed tokens. Level l, column i stands at position root + 1 +
i + l and sees the root, level 0's columns up to i and its own column's levels below it — so each
column reads as a run of consecutive guesses, and the target's prediction after the top of column
i completes an n-gram: the column's N − 1 tokens and that prediction. The window then drops its
oldest level and the predictions become its newest (a Jacobi step). The pool keeps the n-grams by
first token; those starting with the root are the candidates the same pass verifies, each a branch
that sees only the root and itself. Nothing here decides what is emitted: the step loop verifies
the candidates with `rejection.accept_candidates_*`, exact whatever the window guessed, and keeps
the accepted branch's keys and values (`PagedCache.keep_branch`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from policies.drafters import DrafterConfig

from ..kv import BlockStructure
from ..models import LoadedModel
from .drafters import Drafter, DraftJudge, DraftRow, Proposal, StructuredDraft, named


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
class LookaheadBlock(StructuredDraft):
    """One pass's block for a row: the root, the candidates' branches, then the window."""

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
    structure = BlockStructure(torch.tensor(offsets), sees)
    return LookaheadBlock(tokens, structure, [list(c) for c in candidates], branches, top)


def block_width(window: int, ngram: int, guesses: int) -> int:
    """Positions of the widest lookahead block: the root, G candidates and the window."""
    return 1 + (window + guesses) * (ngram - 1)


@dataclass
class _Lookahead:
    """One sequence's window and pool, and the block its last proposal ran."""

    window: JacobiWindow
    pool: NgramPool
    block: LookaheadBlock | None = None


class LookaheadDrafter(Drafter):
    """Lookahead decoding as a drafter: no draft model; each proposal is one structured block
    (`lookahead_block`) whose window the target runs in the verifying pass itself, and whose
    candidates — the pool's n-grams starting with the newest token, cut to the k asked for — the
    step loop verifies with the multi-candidate rule. Drafting is bookkeeping (free); what it costs
    is the wider pass, 1 + (W + G)·(N − 1) positions."""

    name = "lookahead"  # the registry's builder names it with its W, N and G
    free = True

    def __init__(self, window: int, ngram: int, guesses: int):
        if window < 1 or ngram < 2 or guesses < 1:
            raise ValueError(f"lookahead needs W ≥ 1, N ≥ 2 and G ≥ 1 (got W={window}, N={ngram}, G={guesses})")
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.max_draft = ngram - 1
        self.widest_block = block_width(window, ngram, guesses)
        self._rows: dict[int, _Lookahead] = {}

    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int], judge: DraftJudge | None = None) -> Proposal:
        tokens, structured = [], []
        for row, k in zip(rows, ks, strict=True):
            state = self._state(row)
            root = row.token_ids[-1]
            candidates: list[list[int]] = []
            for candidate in state.pool.candidates(root, self.guesses):
                if candidate[:k] not in candidates:  # cut to k, two may coincide
                    candidates.append(candidate[:k])
            state.block = lookahead_block(root, candidates, state.window)
            structured.append(state.block)
            tokens.append(max(candidates, key=len) if candidates else [])
        return Proposal(tokens, structured=structured)

    def observe_block(self, rows: Sequence[DraftRow], argmax: Sequence[torch.Tensor]) -> None:
        """The Jacobi step: the target's predictions after the window's top level complete one
        n-gram per column for the pool, and become the window's newest level."""
        for row, predicted in zip(rows, argmax, strict=True):
            state = self._rows.get(row.key)
            if state is None or state.block is None:
                continue
            for ngram in state.window.advance(predicted[state.block.top_level].tolist()):
                state.pool.add(ngram)
            state.block = None

    def release(self, key: int) -> None:
        self._rows.pop(key, None)

    def fresh(self) -> LookaheadDrafter:
        return self._named_as_me(LookaheadDrafter(self.window, self.ngram, self.guesses))

    def _state(self, row: DraftRow) -> _Lookahead:
        state = self._rows.get(row.key)
        if state is None:  # seeded by the request key: the same request guesses the same way
            seed = row.prompt_ids or row.token_ids
            state = _Lookahead(
                JacobiWindow(self.window, self.ngram, seed, random.Random(row.key)), NgramPool(self.guesses)
            )
            self._rows[row.key] = state
        return state


def build_lookahead(config: DrafterConfig, target: LoadedModel) -> Drafter:
    drafter = LookaheadDrafter(config.lookahead_window, config.lookahead_ngram, config.lookahead_guesses)
    return named(drafter, config)
