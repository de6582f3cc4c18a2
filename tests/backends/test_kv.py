"""The paged KV cache: every sequence attends to exactly its own tokens at its own positions,
whatever else joins, grows, is cut back or leaves, and the pool never holds more than it may."""

import pytest
import torch

from backends.kv import BlockStructure, CacheFull, PagedCache

from ..conftest import NATIVE_BF16_ONLY

TOL = {"atol": 1e-4, "rtol": 1e-4}


@torch.inference_mode()
def _clean_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits after `tokens`, with no cache at all."""
    return model(input_ids=torch.tensor([tokens])).logits[0, -1]


@torch.inference_mode()
def test_rows_of_different_lengths_attend_only_to_their_own_tokens(tiny_target):
    model = tiny_target.model
    cache = PagedCache(model, 1024, block_tokens=4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    seqs = [cache.add() for _ in prompts]
    last = cache.last_logits(seqs, prompts)
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(last[row], _clean_logits(model, prompt), **TOL)
    blocks = [[30, 31, 32, 33], [40]]
    every = cache.logits(seqs, blocks, width=6)  # right-padded past the longest block
    assert every.shape[:2] == (2, 6)
    for row, (prompt, block) in enumerate(zip(prompts, blocks, strict=True)):
        for j in range(len(block)):
            torch.testing.assert_close(every[row, j], _clean_logits(model, prompt + block[: j + 1]), **TOL)


@torch.inference_mode()
def test_cutting_back_rejected_tokens_leaves_exactly_the_kept_prefix(tiny_target):
    model = tiny_target.model
    cache = PagedCache(model, 1024, block_tokens=4)
    seqs = [cache.add(), cache.add()]
    cache.last_logits(seqs, [[5, 6, 7], [8, 9]])
    cache.logits(seqs, [[10, 11, 12, 13, 14, 15], [16, 17]])
    cache.truncate(seqs[0], 4)  # keeps 5 6 7 10: the rest were rejected drafts
    cache.truncate(seqs[1], 4)
    assert (cache.length(seqs[0]), cache.length(seqs[1])) == (4, 4)
    assert len(cache.sequences[seqs[0]].blocks) == 1  # blocks past the kept prefix went back to the pool
    logits = cache.last_logits(seqs, [[50], [60]])
    torch.testing.assert_close(logits[0], _clean_logits(model, [5, 6, 7, 10, 50]), **TOL)
    torch.testing.assert_close(logits[1], _clean_logits(model, [8, 9, 16, 17, 60]), **TOL)
    with pytest.raises(ValueError, match=r"truncate can only shorten a sequence \(5 → 9\)"):
        cache.truncate(seqs[0], 9)


@torch.inference_mode()
def test_joining_and_leaving_never_touch_another_sequences_keys(tiny_target):
    model = tiny_target.model
    cache = PagedCache(model, 1024, block_tokens=4)
    stay = cache.add()
    cache.last_logits([stay], [[5, 6, 7, 8, 9]])
    blocks = list(cache.sequences[stay].blocks)
    slots = [b * 4 + j for b in blocks for j in range(4)][:5]  # where its 5 tokens' keys live

    def stored() -> list[torch.Tensor]:
        return [pool[slots].clone() for pool in (*cache.keys, *cache.values)]

    snapshot = stored()
    joined = cache.add()
    cache.last_logits([joined, stay], [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11]])  # a newcomer shares a pass
    cache.remove(joined)
    again = cache.add()
    cache.last_logits([again], [[3, 3, 3]])  # reuses the freed blocks
    assert cache.sequences[stay].blocks[: len(blocks)] == blocks
    assert all(torch.equal(x, y) for x, y in zip(snapshot, stored(), strict=True))  # bit for bit
    logits = cache.last_logits([stay], [[12]])
    torch.testing.assert_close(logits[0], _clean_logits(model, [5, 6, 7, 8, 9, 11, 12]), **TOL)


@torch.inference_mode()
def test_the_pool_grows_on_demand_and_never_past_its_bound(tiny_target):
    model = tiny_target.model
    cache = PagedCache(model, max_tokens=64 * 4, block_tokens=4)  # 64 blocks: the first pool is all of it
    assert cache.can_reserve(64 * 4) and not cache.can_reserve(64 * 4 + 1)
    big = cache.add(reserve=200)
    assert not cache.can_reserve(60)  # 50 blocks promised, 14 left
    assert cache.can_reserve(56)
    with pytest.raises(CacheFull, match="no room to reserve 60 tokens"):
        cache.add(reserve=60)
    cache.remove(big)
    assert cache.can_reserve(256)
    small = PagedCache(model, max_tokens=4096, block_tokens=4)
    start = small.keys[0].shape[0]
    seq = small.add()
    prompt = list(range(3, 3 + 400))
    logits = small.last_logits([seq], [prompt])  # more than the first pool: it doubles, keeping what it held
    assert small.keys[0].shape[0] > start
    torch.testing.assert_close(logits[0], _clean_logits(model, prompt), **TOL)
    with pytest.raises(CacheFull, match=r"the KV pool is full \(1024 blocks of 4 tokens\)"):
        small.last_logits([seq], [list(range(5000))])


@torch.inference_mode()
def test_padding_repeats_the_last_real_position_and_writes_nowhere_read(tiny_target):
    cache = PagedCache(tiny_target.model, 1024, block_tokens=4)
    seqs = [cache.add(), cache.add()]
    cache.last_logits(seqs, [[5, 6, 7], [8]])
    positions, mask = cache._plan(seqs, [3, 1], [2, 0], width=4, tiled=False)
    cache._pass = None
    assert positions.tolist() == [[3, 4, 4, 4], [0, 0, 0, 0]]  # an empty block: all padding, at its last position
    assert mask.shape == (2, 1, 4, 8)
    assert mask[0, 0, 0].tolist() == [True] * 4 + [False] * 4  # the first new token sees the prompt and itself
    assert mask[1, 0, 0].tolist() == [True] + [False] * 7  # padding of an empty block sees the row's one token


@pytest.mark.slow
def test_feature_layers_are_the_models_own_hidden_states(loaded):
    """What feature drafters read: transformers' hidden_states at the chosen indices, captured by
    hooks during the cache's own passes (a prompt, then a right-padded block)."""
    model = loaded.model
    layers = [0, 4, model.config.num_hidden_layers]
    cache = PagedCache(model, 4096, feature_layers=layers)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    seqs = [cache.add(), cache.add()]
    cache.last_logits(seqs, prompts)
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
    features = cache.features(layers)
    assert features.shape == (2, 5, 3 * model.config.hidden_size)
    torch.testing.assert_close(features[0], torch.cat([hidden[i][0] for i in layers], dim=-1), rtol=1e-3, atol=1e-3)
    cache.logits(seqs, [[6, 9], [3]])
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([prompts[0] + [6, 9]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(
        cache.features(layers)[0], torch.cat([full[i][0, 5:] for i in layers], -1), rtol=1e-3, atol=1e-3
    )


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tiny_target_bf16", pytest.param("loaded_bf16", marks=NATIVE_BF16_ONLY)])
@pytest.mark.parametrize("context", [40, 300, 505, 1030], ids=lambda n: f"context{n}")
def test_width_invariant_passes_give_a_token_the_same_logits_alone_or_in_a_block(target, context, request):
    """bfloat16: nine tokens fed one pass each and fed in one pass get bit-identical logits when
    every pass is a tile (here 9 wide) and its key columns whole attention splits; contexts on both
    sides of a split (512) and a block straddling one."""
    loaded_bf16 = request.getfixturevalue(target)
    generator = torch.Generator().manual_seed(context)
    tokens = torch.randint(0, loaded_bf16.model.config.vocab_size, (context + 9,), generator=generator).tolist()
    alone, block = (PagedCache(loaded_bf16.model, 2048, tile=9) for _ in range(2))
    one, many = alone.add(), block.add()
    with torch.inference_mode():
        for cache, seq in ((alone, one), (block, many)):
            cache.forward([seq], [tokens[:context]], keep="last")
        singles = torch.stack([alone.logits([one], [[t]])[0, 0] for t in tokens[context:]])
        together = block.logits([many], [tokens[context:]])[0]
    assert together.shape == singles.shape == (9, loaded_bf16.model.config.vocab_size)
    assert torch.equal(singles, together)


def test_a_tile_computes_only_the_real_positions_logits_and_refuses_wider_blocks(tiny_target):
    cache = PagedCache(tiny_target.model, 256, tile=4)
    seq = cache.add()
    with torch.inference_mode():
        assert cache.logits([seq], [[1, 2]]).shape[1] == 2  # padding's logits are never computed
        assert cache.length(seq) == 2
        with pytest.raises(ValueError, match="4 positions wide"):
            cache.logits([seq], [[1, 2, 3, 4, 5]])


def test_passes_over_more_sequences_than_tile_rows_run_at_natural_widths(tiny_target):
    """A batch's pass is not tiled: its widths are its own (wider than the tile too), and its
    logits are those of a cache without tiles; a lone sequence's pass still is."""
    tiled, plain = PagedCache(tiny_target.model, 512, tile=4, tile_rows=1), PagedCache(tiny_target.model, 512)
    assert tiled.tiles(1) and not tiled.tiles(2)
    outputs, rows = [], {}
    with torch.inference_mode():
        for cache in (tiled, plain):
            rows[id(cache)] = seqs = [cache.add(), cache.add()]
            cache.last_logits(seqs, [[5, 6, 7], [8, 9]])
            outputs.append(cache.logits(seqs, [[1, 2, 3, 4, 5, 6], [7]]))
        with pytest.raises(ValueError, match="4 positions wide"):
            tiled.logits(rows[id(tiled)][:1], [[1, 2, 3, 4, 5]])
    assert outputs[0].shape == outputs[1].shape == (2, 6, tiny_target.model.config.vocab_size)
    torch.testing.assert_close(outputs[0], outputs[1])


def _branches(root: int, branches: list[list[int]]) -> tuple[list[int], BlockStructure]:
    """A block of a root token and branches that each continue it, laid out one after another."""
    block, offsets, owner = [root], [0], [-1]
    for b, branch in enumerate(branches):
        for depth, token in enumerate(branch):
            block.append(token)
            offsets.append(depth + 1)
            owner.append(b)
    size = len(block)
    sees = torch.eye(size, dtype=torch.bool)
    sees[:, 0] = True  # everything continues the root
    for i in range(size):
        for j in range(1, i):  # earlier tokens of its own branch
            sees[i, j] |= owner[i] == owner[j]
    return block, BlockStructure(torch.tensor(offsets), sees)


@torch.inference_mode()
def test_a_structured_block_computes_every_branch_as_if_it_ran_alone(tiny_target):
    model = tiny_target.model
    cache = PagedCache(model, 1024, block_tokens=4)
    prompt, root, branches = [5, 6, 7, 8, 9], 10, [[11, 12, 13], [21, 22], [31]]
    rows = [cache.add(), cache.add()]
    cache.last_logits(rows, [prompt, [40, 41]])
    block, structure = _branches(root, branches)
    # Beside a plain row whose block is a chain, in the same pass.
    logits = cache.logits(rows, [block, [42, 43]], structures=[structure, None])
    torch.testing.assert_close(logits[0, 0], _clean_logits(model, [*prompt, root]), **TOL)
    at = 1
    for branch in branches:
        for depth in range(len(branch)):
            want = _clean_logits(model, [*prompt, root, *branch[: depth + 1]])
            torch.testing.assert_close(logits[0, at], want, **TOL)
            at += 1
    torch.testing.assert_close(logits[1, 1], _clean_logits(model, [40, 41, 42, 43]), **TOL)
    # The first branch sits right after the root: truncating keeps exactly it.
    cache.truncate(rows[0], len(prompt) + 1 + 2)
    after = cache.last_logits([rows[0]], [[50]])
    torch.testing.assert_close(after[0], _clean_logits(model, [*prompt, root, 11, 12, 50]), **TOL)


def test_a_block_structure_must_fit_its_block(tiny_target):
    with pytest.raises(ValueError, match="every token seeing itself"):
        BlockStructure(torch.tensor([0, 1]), torch.zeros(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="before the cached context"):
        BlockStructure(torch.tensor([0, -1]), torch.eye(2, dtype=torch.bool))
    cache = PagedCache(tiny_target.model, 1024, block_tokens=4)
    seq = cache.add()
    structure = BlockStructure(torch.tensor([0, 1]), torch.eye(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="a block structure of 2 tokens for a block of 3"):
        cache.logits([seq], [[1, 2, 3]], structures=[structure])
    with pytest.raises(ValueError, match="1 block structures for 2 rows"):
        cache.logits([seq, cache.add()], [[1, 2], [3]], structures=[structure])


# ---- prefix caching ----


def _prefilled(cache: PagedCache, prompt: list[int], salt: str | None = None) -> tuple[int, torch.Tensor]:
    """A sequence given `prompt`, fed what the cache did not hold, its prompt registered: (seq, last logits)."""
    seq = cache.add(len(prompt) + 8, prompt, salt)
    logits = cache.last_logits([seq], [prompt[cache.length(seq) :]])[0]
    cache.commit(seq, prompt)
    return seq, logits


@torch.inference_mode()
def test_a_shared_prefix_is_computed_once_and_read_by_every_sequence_that_starts_with_it(tiny_target):
    model = tiny_target.model
    cache = PagedCache(model, 1024, block_tokens=4, prefix_caching=True)
    system = list(range(10, 23))  # 13 tokens: three full blocks
    first, _ = _prefilled(cache, [*system, 40, 41])
    second, logits = _prefilled(cache, [*system, 50])
    assert cache.length(first) == 15 and cache.cached_tokens(second) == 12  # the three full blocks, no more
    assert cache.sequences[second].blocks[:3] == cache.sequences[first].blocks[:3]  # shared, not copied
    torch.testing.assert_close(logits, _clean_logits(model, [*system, 50]), **TOL)
    # a prompt that is exactly cached blocks still feeds its last token: its logits are sampled from
    exact, logits = _prefilled(cache, system[:12])
    assert cache.cached_tokens(exact) == 8
    torch.testing.assert_close(logits, _clean_logits(model, system[:12]), **TOL)
    assert (cache.prefix_stats.queries, cache.prefix_stats.hits) == (15 + 14 + 12, 0 + 12 + 8)
    # shared blocks count once: 3 shared, and one of its own each (the last recomputes [18..21])
    assert cache.usage == pytest.approx(6 / (cache.max_blocks - 1))


@torch.inference_mode()
def test_a_sequence_mid_prefill_adopts_the_blocks_another_registered_after_it_joined(tiny_target):
    model = tiny_target.model
    cache = PagedCache(model, 1024, block_tokens=4, prefix_caching=True)
    system = list(range(10, 27))  # 17 tokens: four full blocks
    late = cache.add(40, [*system, 60, 61])  # joined before anything was cached: found nothing
    cache.last_logits([late], [system[:4]])  # its first chunk
    cache.commit(late, [*system, 60, 61])
    assert cache.next_key(late, [*system, 60, 61]) is not None
    first, _ = _prefilled(cache, [*system, 50])  # found the late one's block, computed the rest
    assert cache.adopt(late, [*system, 60, 61]) == 12  # three more full blocks, shared
    assert cache.sequences[late].blocks[:4] == cache.sequences[first].blocks[:4]
    assert cache.cached_tokens(late) == 12 and cache.length(late) == 16
    logits = cache.last_logits([late], [[26, 60, 61]])[0]
    torch.testing.assert_close(logits, _clean_logits(model, [*system, 60, 61]), **TOL)
    # mid-block, or with nothing more cached, there is nothing to adopt and no next block to offer
    assert cache.adopt(late, [*system, 60, 61]) == 0 and cache.next_key(late, [*system, 60, 61]) is None
    off = PagedCache(model, 1024, block_tokens=4)
    seq = off.add(40, system)
    assert off.adopt(seq, system) == 0 and off.next_key(seq, system) is None


@torch.inference_mode()
def test_salts_and_different_tokens_never_share_a_block(tiny_target):
    cache = PagedCache(tiny_target.model, 1024, block_tokens=4, prefix_caching=True)
    prompt = list(range(10, 30))
    _prefilled(cache, prompt, salt="tenant-a")
    assert cache.cached_tokens(cache.add(30, prompt, "tenant-b")) == 0
    assert cache.cached_tokens(cache.add(30, prompt)) == 0
    assert cache.cached_tokens(cache.add(30, prompt, "tenant-a")) == 16
    # a block is keyed by every token before it: the same second block after another first one is not found
    assert cache.cached_tokens(cache.add(30, [99, *prompt[1:]], "tenant-a")) == 0
    off = PagedCache(tiny_target.model, 1024, block_tokens=4)
    _prefilled(off, prompt)
    assert off.cached_tokens(off.add(30, prompt)) == 0 and off.prefix_stats.queries == 0


@torch.inference_mode()
def test_only_verified_tokens_are_registered(tiny_target):
    cache = PagedCache(tiny_target.model, 1024, block_tokens=4, prefix_caching=True)
    seq = cache.add(40)
    cache.last_logits([seq], [[10, 11, 12, 13, 14, 15]])
    cache.logits([seq], [[16, 17, 18, 19, 20]])  # 16 and 17 verified, 18-20 drafts not yet judged
    cache.commit(seq, [10, 11, 12, 13, 14, 15, 16, 17])  # the caller's verified context
    assert cache.cached_tokens(cache.add(40, [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])) == 8
    cache.truncate(seq, 8)
    cache.remove(seq)


@torch.inference_mode()
def test_idle_cached_blocks_are_reused_until_the_pool_needs_them_least_recently_used_first(tiny_target):
    model = tiny_target.model
    cache = PagedCache(model, max_tokens=8 * 4, block_tokens=4, prefix_caching=True)  # 8 blocks in all
    old, new = list(range(10, 19)), list(range(30, 39))  # 9 tokens: two full blocks each
    for prompt in (old, new):
        seq, _ = _prefilled(cache, prompt)
        cache.remove(seq)
    assert cache.usage == 0 and cache.can_reserve(32)  # idle cached blocks are room
    assert cache.cached_tokens(cache.add(0, old)) == 8  # `old` is used again: now the most recent
    cache.remove(max(cache.sequences))
    filler = cache.add(24)
    cache.fill(filler, 24)  # the four free blocks, then the two least recently used idle ones: `new`'s
    assert cache.cached_tokens(cache.add(0, new)) == 0
    cache.remove(filler)
    seq, logits = _prefilled(cache, [*old, 77])
    assert cache.cached_tokens(seq) == 8
    torch.testing.assert_close(logits, _clean_logits(model, [*old, 77]), **TOL)
    # blocks another sequence holds are room a newcomer with that prefix does not need
    assert not cache.can_reserve(20) and cache.can_reserve(20, [*old, 1])


@torch.inference_mode()
def test_cutting_a_sequence_back_into_a_shared_block_copies_it_first(tiny_target):
    model = tiny_target.model
    cache = PagedCache(model, 1024, block_tokens=4, prefix_caching=True)
    prompt = list(range(10, 19))
    owner, _ = _prefilled(cache, prompt)
    reader = cache.add(20, prompt)
    shared = cache.sequences[reader].blocks[1]
    cache.truncate(reader, 6)  # into its second (shared) block: it will write past position 6
    assert cache.sequences[reader].blocks[1] != shared
    logits = cache.last_logits([reader], [[60, 61]])[0]
    torch.testing.assert_close(logits, _clean_logits(model, [*prompt[:6], 60, 61]), **TOL)
    ownlogits = cache.last_logits([owner], [[70]])[0]  # the owner's keys were never overwritten
    torch.testing.assert_close(ownlogits, _clean_logits(model, [*prompt, 70]), **TOL)
