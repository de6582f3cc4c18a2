"""A cache with holes must attend exactly like a clean cache holding only the valid tokens."""

import pytest
import torch

from backends.speculative.kv import BatchedCache

PAD = 2


def _clean_logits(model, tokens: list[int], last: int) -> torch.Tensor:
    """Logits for `last` after `tokens`, from a fresh single-row cache."""
    cache = BatchedCache(model, PAD)
    cache.prefill([tokens])
    return cache.extend([[last]])[0, -1]


def _valid_tokens(history: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return [h[:n] for h, n in zip(history, lengths, strict=True)]


@torch.inference_mode()
def test_rows_with_holes_attend_only_to_their_valid_tokens(tiny_target):
    model = tiny_target.model
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    cache = BatchedCache(model, PAD)
    cache.prefill(prompts)
    history = [list(p) for p in prompts]
    blocks = [[30, 31, 32, 33], [40]]
    cache.extend(blocks)
    history = [h + b for h, b in zip(history, blocks, strict=True)]
    keep = [len(prompts[0]) + 1, len(prompts[1]) + 1]  # row 0 rejects 3 of its 4, row 1 keeps its one
    cache.truncate(keep)
    assert cache.lengths.tolist() == keep
    valid = _valid_tokens(history, keep)
    logits = cache.extend([[50], [60]])[:, -1]
    for row, last in enumerate([50, 60]):
        torch.testing.assert_close(logits[row], _clean_logits(model, valid[row], last), atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_batch_of_one_is_cropped_with_no_holes(tiny_target):
    cache = BatchedCache(tiny_target.model, PAD)
    cache.prefill([[5, 6, 7]])
    cache.extend([[8, 9, 10, 11]])
    cache.truncate([5])
    assert cache.mask.shape[1] == 5 and bool(cache.mask.all())
    assert cache.cache.get_seq_length() == 5


@torch.inference_mode()
def test_compaction_keeps_every_row_equivalent(tiny_target):
    model = tiny_target.model
    cache = BatchedCache(model, PAD)
    cache.prefill([[5, 6, 7], [8, 9]])
    history = [[5, 6, 7], [8, 9]]
    for step in range(6):  # row 0 keeps everything, row 1 rejects most: holes pile up in row 1
        block = [[100 + step, 101 + step, 102 + step], [200 + step, 201 + step, 202 + step]]
        cache.extend(block)
        history = [h + b for h, b in zip(history, block, strict=True)]
        lengths = cache.lengths.tolist()
        keep = [lengths[0], lengths[1] - 2]
        history[1] = history[1][: keep[1]]
        cache.truncate(keep)
    before = cache.extend([[7], [7]])[:, -1]
    cache.truncate([len(h) for h in history])
    cache.compact()
    assert cache.holes() == 0
    after = cache.extend([[7], [7]])[:, -1]
    torch.testing.assert_close(before, after, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after[1], _clean_logits(model, history[1], 7), atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_select_keeps_the_chosen_rows_intact(tiny_target):
    model = tiny_target.model
    cache = BatchedCache(model, PAD)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    cache.prefill(prompts)
    cache.select([2])
    assert cache.batch_size == 1 and cache.lengths.tolist() == [3]
    torch.testing.assert_close(cache.extend([[9]])[0, -1], _clean_logits(model, prompts[2], 9), atol=1e-4, rtol=1e-4)


def test_truncate_cannot_lengthen_a_row(tiny_target):
    cache = BatchedCache(tiny_target.model, PAD)
    with torch.inference_mode():
        cache.prefill([[5, 6]])
    with pytest.raises(ValueError):
        cache.truncate([3])


@torch.inference_mode()
def test_extend_last_returns_the_logits_after_each_rows_last_new_token(tiny_target):
    model = tiny_target.model
    full, last = BatchedCache(model, PAD), BatchedCache(model, PAD)
    for cache in (full, last):
        cache.prefill([[5, 6, 7], [8, 9]])
    blocks = [[10, 11, 12, 13], [14]]
    every = full.extend(blocks)
    torch.testing.assert_close(last.extend_last(blocks), torch.stack([every[0, 3], every[1, 0]]))
    assert last.lengths.tolist() == full.lengths.tolist() == [7, 3]


@torch.inference_mode()
def test_padding_repeats_the_last_real_position_and_stays_a_hole(tiny_target):
    cache = BatchedCache(tiny_target.model, PAD)
    cache.prefill([[5, 6, 7], [8]])
    input_ids, positions = cache._append([[9, 10], []], width=4)
    assert positions.tolist() == [[3, 4, 4, 4], [0, 0, 0, 0]]  # an empty block: all padding, at its last position
    assert cache.mask[:, -4:].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert cache.lengths.tolist() == [5, 1]


@pytest.mark.slow
def test_feature_layers_are_the_models_own_hidden_states(loaded):
    """What feature drafters read: transformers' hidden_states at the chosen indices, captured by
    hooks during the cache's own passes (prefill, then a right-padded block)."""
    model, pad = loaded.model, loaded.tokenizer.pad_token_id
    layers = [0, 4, model.config.num_hidden_layers]
    cache = BatchedCache(model, pad, feature_layers=layers)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    cache.prefill(prompts)
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i][0] for i in layers], dim=-1)
    assert cache.features is not None and cache.features.shape == (2, 5, 3 * model.config.hidden_size)
    torch.testing.assert_close(cache.features[0], expected, rtol=1e-3, atol=1e-3)
    cache.extend([[6, 9], [3]])
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([prompts[0] + [6, 9]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(cache.features[0], torch.cat([full[i][0, 5:] for i in layers], -1), rtol=1e-3, atol=1e-3)
