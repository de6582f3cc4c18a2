"""The pass timer runs every width in each round (a slow spell spoils one round of all widths),
keeps the best, stops early once rounds are long enough, and leaves nothing in the cache it made."""

import math

import pytest

from backends import pass_timing
from backends.kv import PagedCache
from backends.pass_timing import measure_step_times


@pytest.fixture
def passes(monkeypatch):
    """Record the width of every pass the timer runs."""
    widths: list[int] = []
    real = PagedCache.logits

    def logits(self, seqs, tokens, *args, **kwargs):
        widths.append(len(tokens[0]))
        return real(self, seqs, tokens, *args, **kwargs)

    monkeypatch.setattr(pass_timing.PagedCache, "logits", logits)
    return widths


def test_every_round_goes_round_every_width_after_one_untimed_pass(tiny_target, passes):
    seconds = measure_step_times(tiny_target.model, 2, [1, 4], context=16, repeats=3)
    assert set(seconds) == {1, 4} and all(0 < s < math.inf for s in seconds.values())
    assert passes == [1] + [1, 4] * 3


def test_rounds_stop_after_two_once_they_have_taken_enough(tiny_target, passes):
    measure_step_times(tiny_target.model, 1, [1, 3], context=8, repeats=6, enough_s=0.0)
    assert passes == [1] + [1, 3] * 2


def test_tiled_widths_are_one_computation_so_they_share_the_best_time(tiny_target):
    tiled = measure_step_times(tiny_target.model, 1, [1, 2, 4], context=8, repeats=2, tile=4, tile_rows=1)
    assert len(set(tiled.values())) == 1  # every pass ran 4 positions wide: any difference was noise
    untiled = measure_step_times(tiny_target.model, 2, [1, 2, 4], context=8, repeats=2, tile=4, tile_rows=1)
    assert len(set(untiled.values())) == 3  # two rows are past tile_rows: natural widths, timed apart
