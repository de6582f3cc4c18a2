"""Lookahead decoding's parts: the pool keeps recent n-grams, the Jacobi window completes one per
column and shifts, the structured block shows every token exactly the sequence it continues, and
a lookahead decode emits the target's greedy tokens exactly."""

import random

import pytest
import torch

from backends.kv import PagedCache
from backends.speculative.lookahead import JacobiWindow, NgramPool, lookahead_block, lookahead_greedy

TOL = {"atol": 1e-4, "rtol": 1e-4}


@torch.inference_mode()
def _clean_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0, -1]


@torch.inference_mode()
def _plain_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    cache = PagedCache(model, 4096)
    seq = cache.add()
    tokens = [int(cache.last_logits([seq], [prompt])[0].argmax())]
    while len(tokens) < max_tokens:
        tokens.append(int(cache.last_logits([seq], [[tokens[-1]]])[0].argmax()))
    return tokens


def test_the_pool_keeps_each_first_tokens_newest_distinct_continuations():
    pool = NgramPool(per_key=2)
    for ngram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [9, 9, 9]):
        pool.add(ngram)
    assert pool.candidates(1, 5) == [[6, 7], [2, 3]]  # [4, 5] fell out; [2, 3] counted once
    assert pool.candidates(1, 1) == [[6, 7]] and pool.candidates(2, 5) == [] and len(pool) == 3


def test_the_window_completes_an_ngram_per_column_and_shifts_a_level():
    window = JacobiWindow(window=3, ngram=3, seed_tokens=[7], rng=random.Random(0))
    window.levels = [[1, 2, 3], [4, 5, 6]]
    assert window.tokens() == [1, 2, 3, 4, 5, 6] and window.size == 6
    assert window.advance([7, 8, 9]) == [[1, 4, 7], [2, 5, 8], [3, 6, 9]]
    assert window.levels == [[4, 5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match="W ≥ 1 and N ≥ 2"):
        JacobiWindow(window=0, ngram=3, seed_tokens=[1], rng=random.Random(0))
    with pytest.raises(ValueError, match="the prompt is empty"):
        JacobiWindow(window=2, ngram=3, seed_tokens=[], rng=random.Random(0))


@torch.inference_mode()
def test_every_token_of_the_block_sees_exactly_the_sequence_it_continues(tiny_target):
    model = tiny_target.model
    prompt, root = [5, 6, 7, 8, 9], 10
    window = JacobiWindow(window=3, ngram=4, seed_tokens=prompt, rng=random.Random(1))
    window.levels = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    candidates = [[41, 42, 43], [51, 52, 53]]
    block = lookahead_block(root, candidates, window)
    assert block.branches == [[1, 2, 3], [4, 5, 6]] and block.top_level == [13, 14, 15]
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
        for column in range(3):
            # Level 0 up to this column, then this column's levels up to this one.
            seen = window.levels[0][: column + 1] + [window.levels[lv][column] for lv in range(1, level + 1)]
            at = 7 + window.index(level, column)
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


@pytest.mark.parametrize(("window", "ngram", "guesses"), [(3, 3, 2), (4, 2, 4), (2, 4, 1)])
def test_lookahead_emits_the_targets_greedy_tokens(tiny_target, window, ngram, guesses):
    model = tiny_target.model
    for prompt in ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [30, 31, 32, 33, 34, 35]):
        run = lookahead_greedy(PagedCache(model, 4096), prompt, 40, window, ngram, guesses, seed=3)
        assert run.tokens == _plain_greedy(model, prompt, 40)
        assert run.passes + run.accepted >= 40 and run.pass_width <= 1 + (window + guesses) * (ngram - 1)


@pytest.mark.slow
def test_lookahead_on_the_embedded_model_is_exact_and_accepts_its_own_ngrams(loaded):
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from 1 to 40, separated by commas."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = loaded.tokenizer(text)["input_ids"]
    run = lookahead_greedy(PagedCache(loaded.model, 4096), prompt, 48, window=4, ngram=3, guesses=4)
    assert run.tokens == _plain_greedy(loaded.model, prompt, 48)
    assert run.accepted > 0 and run.passes < 48  # the window's n-grams were accepted
