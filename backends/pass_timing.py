"""Timing one target pass over the paged cache, as the step loop runs it: what the step-cost
probe, the profiler and the load-time kernel choice measure."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .kv import BLOCK_TOKENS, PagedCache

PROBE_CONTEXT = 64  # tokens per row in the step-cost probe
PROBE_REPEATS = 3


@torch.inference_mode()
def measure_step_times(
    model: torch.nn.Module,
    batch: int,
    widths: Sequence[int],
    context: int = PROBE_CONTEXT,
    repeats: int = PROBE_REPEATS,
    enough_s: float | None = None,
    tile: int | None = None,
    tile_rows: int | None = None,
) -> dict[int, float]:
    """Best-of-`repeats` seconds of a target pass of each width (new tokens per row) over `context`
    cached tokens per row, through the same paged cache the step loop uses. The context is
    placeholder keys and values (a pass costs the same whatever they hold), so no prefill is paid
    for it. The repeats go round all widths in turn, so a slow spell on a busy machine spoils one
    round of every width rather than every try of one width; with `enough_s`, rounds stop after
    two once they have taken that long. With `tile` (and `tile_rows`), passes are width-invariant
    where `PagedCache` makes them so, as a loop in that mode runs them."""
    cache = PagedCache(model, batch * (context + max(widths) + BLOCK_TOKENS), tile=tile, tile_rows=tile_rows)
    seqs = [cache.add() for _ in range(batch)]
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size  # not the LM head: an int8 head has no float weight matrix

    def tokens(width: int) -> list[list[int]]:
        return torch.randint(0, vocab, (batch, width), generator=generator).tolist()

    for seq in seqs:
        cache.fill(seq, context)
    # One untimed pass first: a dtype's first kernels can carry one-off set-up costs (bf16 on CPU).
    float(cache.logits(seqs, tokens(1))[0, -1, 0])
    for seq in seqs:
        cache.truncate(seq, context)
    seconds = dict.fromkeys(widths, float("inf"))
    started = time.perf_counter()
    for round_ in range(repeats):
        if round_ >= 2 and enough_s is not None and time.perf_counter() - started > enough_s:
            break  # passes this long vary little: two rounds are the best of enough
        for width in widths:
            block = tokens(width)
            begun = time.perf_counter()
            float(cache.logits(seqs, block)[0, -1, 0])  # reading a value waits for an asynchronous device
            seconds[width] = min(seconds[width], time.perf_counter() - begun)
            for seq in seqs:
                cache.truncate(seq, context)
    return _pool_tiled(seconds, batch, tile, tile_rows)


def _pool_tiled(seconds: dict[int, float], batch: int, tile: int | None, tile_rows: int | None) -> dict[int, float]:
    """Tiled passes of every width up to the tile are one and the same computation: their
    measurements differ by noise alone, so all of them get the best. Otherwise the step loop would
    pick a 'cheapest' width by noise and the cost model see wide passes dearer or cheaper than they are."""
    if tile is None or (tile_rows is not None and batch > tile_rows):
        return seconds
    same = [w for w in seconds if w <= tile]
    if not same:
        return seconds
    best = min(seconds[w] for w in same)
    return {w: best if w <= tile else s for w, s in seconds.items()}
