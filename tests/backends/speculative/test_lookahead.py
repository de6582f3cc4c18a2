"""Lookahead decoding: the pool keeps recent n-grams, the Jacobi window completes one per column
and shifts, the structured block shows every token exactly the sequence it continues, the drafter
proposes the pool's candidates and learns from the target's argmax over its window — and the step
loop serving it emits the target's greedy tokens exactly (sampling: tests/backends/test_scheduler.py)."""

import random

import pytest
import torch

from backends.generation import GenerationRequest
from backends.kv import PagedCache
from backends.plain import PlainEngine
from backends.sampling import SamplingParams, new_generator
from backends.scheduler import LoopSettings, Scheduler
from backends.speculative.drafters import DraftRow
from backends.speculative.factory import build_drafter
from backends.speculative.lookahead import (
    PROBE_EVERY,
    PROBE_RARELY,
    BlockShape,
    JacobiWindow,
    LookaheadDrafter,
    NgramPool,
    ShapeHistory,
    block_width,
    lookahead_block,
)
from policies.drafters import DrafterConfig

TOL = {"atol": 1e-4, "rtol": 1e-4}


@torch.inference_mode()
def _clean_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def _row(key: int, prompt: list[int], tokens: list[int]) -> DraftRow:
    return DraftRow(key, prompt, tokens, SamplingParams(), new_generator(0)[0])


def test_the_pool_keeps_each_first_tokens_newest_distinct_continuations():
    pool = NgramPool(per_key=2)
    for ngram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [9, 9, 9]):
        pool.add(ngram)
    assert pool.candidates(1, 5) == [[6, 7], [2, 3]]  # [4, 5] fell out; [2, 3] counted once
    assert pool.candidates(1, 1) == [[6, 7]] and pool.candidates(2, 5) == [] and len(pool) == 3
    pool.add([1, 2, 3], column=4)  # the column that produced a continuation last is kept with it
    assert pool.sourced(1) == [([2, 3], 4), ([6, 7], 0)] and pool.sourced(1, columns=4) == [([6, 7], 0)]


def test_the_window_completes_an_ngram_per_column_and_shifts_a_level():
    window = JacobiWindow(window=3, ngram=3, seed_tokens=[7], rng=random.Random(0))
    window.levels = [[1, 2, 3], [4, 5, 6]]
    assert window.tokens() == [1, 2, 3, 4, 5, 6] and window.size == 6
    assert window.advance([7, 8, 9]) == [[1, 4, 7], [2, 5, 8], [3, 6, 9]]
    assert window.levels == [[4, 5, 6], [7, 8, 9]]
    assert window.tokens(2) == [4, 5, 7, 8] and window.advance([1, 2]) == [[4, 7, 1], [5, 8, 2]]
    assert window.levels == [[7, 8, 6], [1, 2, 9]]  # a column not run keeps its guesses
    with pytest.raises(ValueError, match="W ≥ 1 and N ≥ 2"):
        JacobiWindow(window=0, ngram=3, seed_tokens=[1], rng=random.Random(0))
    with pytest.raises(ValueError, match="the prompt is empty"):
        JacobiWindow(window=2, ngram=3, seed_tokens=[], rng=random.Random(0))


@pytest.mark.parametrize("columns", [3, 2])
@torch.inference_mode()
def test_every_token_of_the_block_sees_exactly_the_sequence_it_continues(tiny_target, columns):
    model = tiny_target.model
    prompt, root = [5, 6, 7, 8, 9], 10
    window = JacobiWindow(window=3, ngram=4, seed_tokens=prompt, rng=random.Random(1))
    window.levels = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    candidates = [[41, 42, 43], [51, 52, 53]]
    block = lookahead_block(root, candidates, window, columns)  # 2: the window's first two columns only
    assert block.branches == [[1, 2, 3], [4, 5, 6]] and len(block.tokens) == 7 + 3 * columns
    assert block.top_level == [7 + 2 * columns + i for i in range(columns)]
    cache = PagedCache(model, 1024, block_tokens=4)
    seq = cache.add()
    cache.last_logits([seq], [prompt])
    logits = cache.logits([seq], [block.tokens], structures=[block.structure])[0]
    for candidate, branch in zip(candidates, block.branches, strict=True):
        for depth, at in enumerate(branch):
            torch.testing.assert_close(
                logits[at], _clean_logits(model, [*prompt, root, *candidate[: depth + 1]]), **TOL
            )
    for level in range(3):
        for column in range(columns):
            # Level 0 up to this column, then this column's levels up to this one.
            seen = window.levels[0][: column + 1] + [window.levels[lv][column] for lv in range(1, level + 1)]
            at = 7 + level * columns + column
            torch.testing.assert_close(logits[at], _clean_logits(model, [*prompt, root, *seen]), **TOL)


@torch.inference_mode()
def test_keeping_a_later_branch_moves_its_keys_into_place(tiny_target):
    model = tiny_target.model
    prompt, root = [5, 6, 7], 10
    window = JacobiWindow(window=2, ngram=2, seed_tokens=prompt, rng=random.Random(2))
    block = lookahead_block(root, [[41, 42], [51, 52]], window)
    cache = PagedCache(model, 1024, block_tokens=4)
    seq = cache.add()
    cache.last_logits([seq], [prompt])
    start = cache.length(seq)
    cache.logits([seq], [block.tokens], structures=[block.structure])
    cache.keep_branch(seq, start, [0, *block.branches[1][:1]])  # the root and 51
    assert cache.length(seq) == start + 2
    torch.testing.assert_close(
        cache.last_logits([seq], [[60]])[0], _clean_logits(model, [*prompt, root, 51, 60]), **TOL
    )
    with pytest.raises(ValueError, match="lie outside the pass"):
        cache.keep_branch(seq, start, [0, 9])


def test_the_registry_builds_and_names_it_with_its_widest_pass():
    drafter = build_drafter(DrafterConfig(kind="lookahead"), None)
    assert isinstance(drafter, LookaheadDrafter) and drafter.name == "lookahead-4x3x4"
    assert drafter.widest_block == block_width(4, 3, 4) == 17 and drafter.max_draft == 2 and drafter.free
    assert drafter.fresh().name == drafter.name
    with pytest.raises(ValueError, match="G ≥ 1"):
        LookaheadDrafter(window=2, ngram=3, guesses=0)


def test_the_drafter_proposes_the_pools_ngrams_for_the_newest_token_cut_to_k():
    drafter = LookaheadDrafter(window=2, ngram=4, guesses=3)
    row = _row(7, [5, 6, 7], [9])
    drafter.propose([row], [3])  # creates the row's window and pool
    for ngram in ([9, 1, 2, 3], [9, 1, 2, 4], [9, 8, 8, 8], [4, 4, 4, 4]):
        drafter._rows[7].pool.add(ngram)
    proposal = drafter.propose([row], [2])
    block = proposal.structured[0]
    # Cut to k = 2, [1, 2] came twice; the newest first. [4, 4, 4] does not continue 9.
    assert block.candidates == [[8, 8], [1, 2]] and proposal.tokens == [[8, 8]]
    assert block.tokens[0] == 9 and len(block.tokens) == 1 + 4 + 2 * 3


def test_the_targets_argmax_over_the_window_fills_the_pool_and_shifts_the_window():
    drafter = LookaheadDrafter(window=2, ngram=3, guesses=2)
    row = _row(1, [5, 6, 7], [9])
    window = drafter._state(row).window
    window.levels = [[11, 12], [21, 22]]
    block = drafter.propose([row], [2]).structured[0]
    argmax = torch.zeros(len(block.tokens), dtype=torch.long)
    argmax[block.top_level] = torch.tensor([31, 32])
    drafter.observe_block([row], [argmax])
    assert window.levels == [[21, 22], [31, 32]]
    assert drafter._rows[1].pool.candidates(11, 2) == [[21, 31]] and drafter._rows[1].pool.candidates(12, 2) == [
        [22, 32]
    ]
    drafter.release(1)
    assert drafter._rows == {}


def test_the_history_costs_smaller_shapes_from_whole_window_steps():
    history = ShapeHistory(columns=4, guesses=4, most=8)
    assert history.columns == (1, 2, 4) and history.guesses == (1, 2, 4)
    for _ in range(3):  # the newest candidate, from column 0, matches both tokens; the rest nothing
        history.record([2, 0, 0, 0], [0, 3, 3, 3])
    # Every width costs a 1-token pass: the most tokens win, then the widest (its window advances for free).
    flat = [1.0] * 17
    assert history.choose(ngram=3, cap=2, pass_s=flat) == (BlockShape(4, 4, 2), 3.0)
    assert history.choose(ngram=3, cap=1, pass_s=flat) == (BlockShape(4, 4, 1), 2.0)
    # Where width costs a little, the narrowest window that matches (G′ = 1, 2 or 4 verify the same one candidate).
    rising = [1.0 + 0.01 * w for w in range(17)]
    assert history.choose(ngram=3, cap=2, pass_s=rising)[0] == BlockShape(1, 4, 2)
    steep = [float(w) for w in range(1, 18)]  # a 5-wide pass costs 5 plain ones: 3 tokens do not pay
    assert history.choose(ngram=3, cap=2, pass_s=steep) == (None, 1.0)
    late = ShapeHistory(columns=4, guesses=4, most=8)
    late.record([0, 2], [0, 3])  # only the last column's n-gram matched: the whole window it is
    assert late.choose(ngram=3, cap=2, pass_s=rising)[0] == BlockShape(4, 4, 2)  # G′ = 2 or 4: the same two
    # No match yet where every width costs the same: a shape ties with a plain pass, and runs, so its
    # window keeps feeding the pool (off, nothing would ever match); where width costs, it stays off.
    empty = ShapeHistory(columns=4, guesses=4, most=8)
    empty.record([0, 0], [0, 1])
    assert empty.choose(ngram=3, cap=2, pass_s=flat) == (BlockShape(4, 4, 1), 1.0)
    assert empty.choose(ngram=3, cap=2, pass_s=[1.0] + [1.0 + 1e-6] * 16) == (None, 1.0)


def test_auto_probes_the_whole_block_then_runs_the_shape_that_pays_or_none():
    drafter = LookaheadDrafter(window=2, ngram=3, guesses=2)
    row = _row(3, [5, 6, 7], [9])
    flat, steep = [1.0] * drafter.widest_block, [float(w) for w in range(1, drafter.widest_block + 1)]
    assert drafter.plan_block(row, 2, flat) == 2 and drafter._rows[3].shape is None  # nothing known: probe
    block = drafter.propose([row], [2]).structured[0]
    assert block.probe and len(block.tokens) == 1 + 2 * 2  # no candidates yet, the whole window
    for _ in range(4):
        drafter._history.record([2], [0])  # what whole-block steps of other rows found
    rising = [1.0 + 0.01 * w for w in range(drafter.widest_block)]
    assert drafter.plan_block(row, 2, rising) == 2 and drafter._rows[3].shape == BlockShape(1, 2, 2)
    drafter._rows[3].pool.add([9, 1, 2], column=0)
    drafter._rows[3].pool.add([9, 3, 4], column=1)
    block = drafter.propose([row], [2]).structured[0]
    assert not block.probe and block.candidates == [[1, 2]] and len(block.tokens) == 1 + 2 + 1 * 2
    for _ in range(4):
        drafter._rows[3].history.record([2], [0])  # the row's own whole-block steps, now enough to go by
    off = [drafter.plan_block(row, 2, steep) for _ in range(3 * PROBE_EVERY)]
    # Off, except for a whole-block probe after 8 steps, then 16: a row that stopped retries ever more rarely.
    assert [i for i, k in enumerate(off) if k] == [PROBE_EVERY - 2, 3 * PROBE_EVERY - 2]
    assert drafter._rows[3].probe_every == 4 * PROBE_EVERY
    newcomer = _row(4, [5, 6, 7], [9])  # no steps of its own: every row's history keeps it off from the start
    assert drafter.plan_block(newcomer, 2, steep) == 0 and drafter._rows[4].probe_every == PROBE_RARELY


def _request(text: str, tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt=text, max_tokens=tokens, ignore_eos=True)


@pytest.mark.parametrize(("window", "ngram", "guesses"), [(3, 3, 2), (4, 2, 4), (2, 4, 1)])
def test_the_step_loop_serving_lookahead_emits_the_targets_greedy_tokens(tiny_target, window, ngram, guesses):
    drafter = LookaheadDrafter(window, ngram, guesses)
    requests = [_request("1 2 3 4 1 2 3 4 1 2", 40), _request("Once upon a time", 30), _request("Hi", 12)]
    plain = PlainEngine(tiny_target).generate(requests)
    for k in (ngram - 1, "auto"):
        results = Scheduler(tiny_target, LoopSettings(), [drafter.fresh()], k=k).generate(requests)
        assert [r.token_ids for r in results] == [r.token_ids for r in plain], k
        # Each step's pass width is kept beside its k (the cost model prices a run at those widths):
        # a fixed-k step runs the whole window and the candidates the pool has, at most the block, or
        # (too few tokens left for a block) a 1-token pass.
        widths = [w for r in results for w in r.speculation.width_history]
        assert len(widths) == sum(len(r.speculation.k_history) for r in results)
        assert max(widths) <= drafter.widest_block and max(widths) > window * (ngram - 1)
        assert k == "auto" or all(w == 1 or w > window * (ngram - 1) for w in widths)


@pytest.mark.slow
def test_lookahead_on_the_embedded_model_is_exact_and_accepts_its_own_ngrams(loaded):
    request = GenerationRequest(
        messages=[{"role": "user", "content": "Count from 1 to 40, separated by commas."}], max_tokens=48
    )
    drafter = build_drafter(DrafterConfig(kind="lookahead"), loaded)
    result = Scheduler(loaded, LoopSettings(), [drafter], k=2).generate([request])[0]
    assert result.token_ids == PlainEngine(loaded).generate([request])[0].token_ids
    stats = result.speculation
    assert stats.accepted_tokens > 0 and stats.steps < len(result.token_ids) - 1  # the window's n-grams paid
