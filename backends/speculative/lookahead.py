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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from policies.drafters import DrafterConfig

from ..kv import BlockStructure
from ..models import LoadedModel
from .drafters import Drafter, DraftJudge, DraftRow, Proposal, StructuredDraft, named
from .rejection import candidate_chains, greedy_matches


class NgramPool:
    """N-grams harvested from the window, by first token: each key keeps its `per_key` most
    recent distinct continuations (N − 1 tokens), newest first, each with the window column that
    last produced it (what lets a step running fewer columns be costed from a step running all)."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self._by_first: dict[int, list[tuple[tuple[int, ...], int]]] = {}

    def add(self, ngram: Sequence[int], column: int = 0) -> None:
        first, rest = ngram[0], tuple(ngram[1:])
        kept = [entry for entry in self._by_first.get(first, []) if entry[0] != rest]
        self._by_first[first] = [(rest, column), *kept][: self.per_key]

    def sourced(self, token: int, columns: int | None = None) -> list[tuple[list[int], int]]:
        """The continuations of `token` with their columns, newest first; with `columns`, only
        those the window's first `columns` columns produced."""
        kept = self._by_first.get(token, [])
        return [(list(rest), column) for rest, column in kept if columns is None or column < columns]

    def candidates(self, token: int, limit: int) -> list[list[int]]:
        return [rest for rest, _ in self.sourced(token)[:limit]]

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

    def tokens(self, columns: int | None = None) -> list[int]:
        """Level-major: level 0's columns, then level 1's, … — the first `columns` of each."""
        return [token for level in self.levels for token in level[:columns]]

    def advance(self, predictions: Sequence[int]) -> list[list[int]]:
        """One Jacobi step of the first len(predictions) columns, from the target's predictions
        after their top level: the n-grams completed (one per column), then those columns shifted
        by a level. Columns a step did not run keep their guesses: each column is a trajectory of
        its own (it reads only level 0 of the columns before it)."""
        ran = len(predictions)
        ngrams = [[level[i] for level in self.levels] + [int(predictions[i])] for i in range(ran)]
        for lower, upper in zip(self.levels, self.levels[1:], strict=False):
            lower[:ran] = upper[:ran]
        self.levels[-1][:ran] = [int(t) for t in predictions]
        return ngrams


@dataclass(frozen=True)
class LookaheadBlock(StructuredDraft):
    """One pass's block for a row: the root, the candidates' branches, then the window."""

    top_level: list[int]  # block indices of the window's top level, column by column
    sources: list[int] = field(default_factory=list)  # per candidate, the window column that produced it
    probe: bool = False  # the drafter's whole (W, G) ran: every candidate's match is worth recording


def lookahead_block(
    root: int, candidates: Sequence[Sequence[int]], window: JacobiWindow, columns: int | None = None
) -> LookaheadBlock:
    """The structured block verifying `candidates` (continuations of `root`) and running the
    window's first `columns` columns (all by default)."""
    ran = window.window if columns is None else columns
    tokens, offsets, branches = [root], [0], []
    for candidate in candidates:
        branches.append(list(range(len(tokens), len(tokens) + len(candidate))))
        tokens += list(candidate)
        offsets += list(range(1, len(candidate) + 1))
    base = len(tokens)
    tokens += window.tokens(ran)
    offsets += [1 + i + level for level in range(window.ngram - 1) for i in range(ran)]
    sees = torch.eye(len(tokens), dtype=torch.bool)
    sees[:, 0] = True  # everything continues the root
    for branch in branches:
        for depth, at in enumerate(branch):
            sees[at, branch[:depth]] = True

    def index(level: int, column: int) -> int:
        return base + level * ran + column

    for level in range(window.ngram - 1):
        for column in range(ran):
            sees[index(level, column), [index(0, j) for j in range(column + 1)]] = True
            sees[index(level, column), [index(lower, column) for lower in range(1, level)]] = True
    top = [index(window.ngram - 2, i) for i in range(ran)]
    structure = BlockStructure(torch.tensor(offsets), sees)
    return LookaheadBlock(tokens, structure, [list(c) for c in candidates], branches, top)


def block_width(window: int, ngram: int, guesses: int) -> int:
    """Positions of the widest lookahead block: the root, G candidates and the window."""
    return 1 + (window + guesses) * (ngram - 1)


@dataclass(frozen=True)
class BlockShape:
    """How much of a drafter's (W, G) one step runs: the window's first `columns` columns and the
    pool's first `guesses` candidates from them, each cut to `depth` tokens."""

    columns: int
    guesses: int
    depth: int


TIE = 1e-9  # relative: rates this close are equal (the mean of equal pass costs may differ in its last bit)


def _halvings(most: int) -> tuple[int, ...]:
    """most, most/2, most/4, … 1 (rounded up): the grid of columns and guesses k = auto tries."""
    sizes, size = {most}, most
    while size > 1:
        size = (size + 1) // 2
        sizes.add(size)
    return tuple(sorted(sizes))


class ShapeHistory:
    """What steps that ran the drafter's whole (W, G) found — per candidate, how many of its tokens
    the target's argmax matched, and the column that produced it — kept, per shape of the grid,
    as the longest match and the number of candidates that shape would have verified. Any smaller
    shape is costed from these counterfactually: its candidates were among those verified."""

    def __init__(self, columns: int, guesses: int, most: int):
        self.columns, self.guesses = _halvings(columns), _halvings(guesses)
        self._best: deque[np.ndarray] = deque(maxlen=most)
        self._count: deque[np.ndarray] = deque(maxlen=most)

    def __len__(self) -> int:
        return len(self._best)

    def record(self, matches: Sequence[int], sources: Sequence[int]) -> None:
        self.add(*self.summarize(matches, sources))

    def summarize(self, matches: Sequence[int], sources: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """One whole-(W, G) step as this grid keeps it: per shape, the longest match and the count."""
        best = np.zeros((len(self.columns), len(self.guesses)), dtype=np.int64)
        count = np.zeros_like(best)
        for i, columns in enumerate(self.columns):
            kept = [m for m, source in zip(matches, sources, strict=True) if source < columns]
            for j, guesses in enumerate(self.guesses):
                best[i, j], count[i, j] = max(kept[:guesses], default=0), len(kept[:guesses])
        return best, count

    def add(self, best: np.ndarray, count: np.ndarray) -> None:
        """A step `summarize` made, by a history on the same grid (a row's and its drafter's share one)."""
        self._best.append(best)
        self._count.append(count)

    def choose(self, ngram: int, cap: int, pass_s: Sequence[float]) -> tuple[BlockShape | None, float]:
        """The shape with the most tokens per second by these steps and the measured pass seconds
        per width (pass_s[w − 1]), and its rate; None where a plain 1-token pass does better. Ties
        go to running more of the window: the columns a step runs advance and feed the pool, which
        the history cannot credit. So a shape that only ties with a plain pass runs (where passes of
        every width cost the same, as tiled bfloat16 passes do, a history with no match yet would
        otherwise switch lookahead off), and among tying shapes the one with the most columns, then
        the most guesses."""
        best, count = np.stack(self._best), np.stack(self._count)
        seconds_at = np.asarray(pass_s, dtype=np.float64)
        window = np.asarray(self.columns)[None, :, None] * (ngram - 1)
        chosen, rate = None, 1.0 / seconds_at[0]
        for depth in range(1, cap + 1):
            tokens = 1.0 + np.minimum(best, depth).mean(axis=0)
            seconds = seconds_at[1 + window + count * depth - 1].mean(axis=0)
            rates = tokens / seconds
            i, j = np.argwhere(rates >= rates.max() * (1.0 - TIE))[-1]  # row-major: the most columns, then guesses
            value = rates[i, j]
            if value > rate or (chosen is None and value >= rate * (1.0 - TIE)):
                chosen, rate = BlockShape(self.columns[i], self.guesses[j], depth), value
        return chosen, rate


PROBE_EVERY, PROBE_RARELY = 8, 64  # k = auto runs the whole (W, G) every 8th step; every 64th while off
ENOUGH_STEPS = 4  # whole-(W, G) steps a history needs before it is trusted over probing


@dataclass
class _Lookahead:
    """One sequence's window and pool, the block its last proposal ran, and what k = auto knows."""

    window: JacobiWindow
    pool: NgramPool
    history: ShapeHistory
    block: LookaheadBlock | None = None
    shape: BlockShape | None = None  # this step's, chosen by plan_block (None: the whole (W, G))
    since_probe: int = 0
    probe_every: int = PROBE_EVERY
    on: bool = True


class LookaheadDrafter(Drafter):
    """Lookahead decoding as a drafter: no draft model; each proposal is one structured block
    (`lookahead_block`) whose window the target runs in the verifying pass itself, and whose
    candidates — the pool's n-grams starting with the newest token, cut to the k asked for — the
    step loop verifies with the multi-candidate rule. Drafting is bookkeeping (free); what it costs
    is the wider pass, up to 1 + (W + G)·(N − 1) positions. Under k = auto, `plan_block` picks how
    much of (W, G) and which depth each step runs, or none, from measured pass costs."""

    name = "lookahead"  # the registry's builder names it with its W, N and G
    free = True

    def __init__(self, window: int, ngram: int, guesses: int):
        if window < 1 or ngram < 2 or guesses < 1:
            raise ValueError(f"lookahead needs W ≥ 1, N ≥ 2 and G ≥ 1 (got W={window}, N={ngram}, G={guesses})")
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.max_draft = ngram - 1
        self.widest_block = block_width(window, ngram, guesses)
        self._rows: dict[int, _Lookahead] = {}
        self._history = ShapeHistory(window, guesses, most=256)  # every row's: a new row's prior

    def plan_block(self, row: DraftRow, cap: int, pass_s: Sequence[float]) -> int:
        """k = auto for one row this step (cap ≥ 1): the depth of the shape whose tokens per
        second, by the steps that ran the whole (W, G) — the row's own once it has enough, else
        every row's — beat a plain pass's; 0 where none does. Every 8th step runs the whole
        (W, G), as do the first ones: that is what the history learns from, and how a row that
        stopped finds out whether it would pay again (after 8, 16, 32, then every 64 steps while
        it is off; a new row that every row's history keeps off probes every 64th step at once)."""
        state = self._state(row)
        history = state.history if len(state.history) >= ENOUGH_STEPS else self._history
        state.since_probe += 1
        if len(history) < ENOUGH_STEPS or state.since_probe >= state.probe_every:
            state.since_probe, state.shape = 0, None
            if not state.on:
                state.probe_every = min(2 * state.probe_every, PROBE_RARELY)
            return cap
        state.shape, _ = history.choose(self.ngram, cap, pass_s)
        state.on = state.shape is not None
        if state.on:
            state.probe_every = PROBE_EVERY
        elif history is self._history:  # other rows found it does not pay: start where they backed off to
            state.probe_every = PROBE_RARELY
        return 0 if state.shape is None else state.shape.depth

    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int], judge: DraftJudge | None = None) -> Proposal:
        tokens, structured = [], []
        for row, k in zip(rows, ks, strict=True):
            state = self._state(row)
            shape, state.shape = state.shape or BlockShape(self.window, self.guesses, k), None
            candidates: list[list[int]] = []
            sources: list[int] = []
            for candidate, column in state.pool.sourced(row.token_ids[-1], shape.columns)[: shape.guesses]:
                if candidate[:k] not in candidates:  # cut to k, two may coincide
                    candidates.append(candidate[:k])
                    sources.append(column)
            block = lookahead_block(row.token_ids[-1], candidates, state.window, shape.columns)
            probe = (shape.columns, shape.guesses) == (self.window, self.guesses)
            state.block = replace(block, sources=sources, probe=probe)
            structured.append(state.block)
            tokens.append(max(candidates, key=len) if candidates else [])
        return Proposal(tokens, structured=structured)

    def observe_block(self, rows: Sequence[DraftRow], argmax: Sequence[torch.Tensor]) -> None:
        """The Jacobi step: the target's predictions after the window's top level complete one
        n-gram per column run for the pool, and become those columns' newest level. A block that
        ran the whole (W, G) also tells the histories how far each candidate matched."""
        for row, predicted in zip(rows, argmax, strict=True):
            state = self._rows.get(row.key)
            if state is None or state.block is None:
                continue
            block, state.block = state.block, None
            for column, ngram in enumerate(state.window.advance(predicted[block.top_level].tolist())):
                state.pool.add(ngram, column)
            if block.probe:
                matches = greedy_matches(block.candidates, candidate_chains(predicted, block.branches))
                step = self._history.summarize(matches, block.sources)  # one grid: summarized once for both
                state.history.add(*step)
                self._history.add(*step)

    def release(self, key: int) -> None:
        self._rows.pop(key, None)

    def fresh(self) -> LookaheadDrafter:
        return self._named_as_me(LookaheadDrafter(self.window, self.ngram, self.guesses))

    def _state(self, row: DraftRow) -> _Lookahead:
        state = self._rows.get(row.key)
        if state is None:  # seeded by the request key: the same request guesses the same way
            seed = row.prompt_ids or row.token_ids
            window = JacobiWindow(self.window, self.ngram, seed, random.Random(row.key))
            state = _Lookahead(window, NgramPool(self.guesses), ShapeHistory(self.window, self.guesses, most=32))
            self._rows[row.key] = state
        return state


def build_lookahead(config: DrafterConfig, target: LoadedModel) -> Drafter:
    drafter = LookaheadDrafter(config.lookahead_window, config.lookahead_ngram, config.lookahead_guesses)
    return named(drafter, config)
