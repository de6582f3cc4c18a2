"""The dtype the service serves in: the exact dtype predicted fastest for a lone request, float32
unless another beats it by MIN_GAIN, with the figures in the reason."""

from __future__ import annotations

import pytest

from policies.config import default_policy
from policies.profile import ProfileError
from policies.serving_dtype import MIN_GAIN, choose_dtype, configured, outlook
from tests.policies.profiles import in_dtype, synthetic_profile


def test_a_faster_exact_bfloat16_serves_and_the_reason_gives_both_dtypes_figures():
    fp32 = synthetic_profile()
    bf16 = in_dtype(fp32, "bfloat16", speed=0.5)
    choice = choose_dtype([fp32, bf16], default_policy())
    assert (choice.dtype, choice.source) == ("bfloat16", "measured")
    fast, slow = (next(o for o in choice.outlooks if o.dtype == d) for d in ("bfloat16", "float32"))
    assert fast.exact and fast.tile_width == 9 and slow.exact
    # A tiled bfloat16 step at batch 1: 9 positions wide, half the float32 time of that width.
    assert fast.step_ms == pytest.approx((0.070 + 0.0025 * 9) * 0.5 * 1e3)
    assert fast.best_tokens_per_s > slow.best_tokens_per_s
    assert "bfloat16: " in choice.reason and "× slower served alone" in choice.reason
    assert "runs 9 positions wide" in choice.reason


def test_speculation_counts_in_the_comparison_not_only_the_plain_step():
    fp32 = synthetic_profile()
    o = outlook(fp32, default_policy())
    assert o.best_by_category["copy"].startswith("ngram")  # α 0.8, nearly free drafts: speculation serves it
    assert o.best_tokens_per_s > o.plain_tokens_per_s
    assert o.plain_tokens_per_s == pytest.approx(1 / (0.070 + 0.0025))


def test_bfloat16_at_natural_widths_is_never_served_however_fast():
    fp32 = synthetic_profile()
    inexact = in_dtype(fp32, "bfloat16", speed=0.3, tile_width=None)
    choice = choose_dtype([fp32, inexact], default_policy())
    assert choice.dtype == "float32"
    assert "bfloat16 not considered" in choice.reason


def test_a_gain_under_the_switching_margin_keeps_float32():
    fp32, policy = synthetic_profile(), default_policy()
    # Every bfloat16 pass scaled so that a lone request is served 3 % faster than in float32 (the
    # speedups do not move when every target pass scales alike; prompt lookup's drafts cost ~0).
    probe = in_dtype(fp32, "bfloat16", speed=1.0)
    ratio = outlook(probe, policy).best_tokens_per_s / outlook(fp32, policy).best_tokens_per_s
    close = in_dtype(fp32, "bfloat16", speed=ratio / (MIN_GAIN - 0.02))
    choice = choose_dtype([fp32, close], policy)
    gain = choice.outlooks[1].best_tokens_per_s / choice.outlooks[0].best_tokens_per_s
    assert 1 < gain < MIN_GAIN
    assert choice.dtype == "float32" and "short of the 1.05× a switch needs" in choice.reason


def test_only_a_missing_profile_is_named_and_no_exact_profile_is_an_error():
    fp32 = synthetic_profile()
    choice = choose_dtype([fp32], default_policy(), missing="bfloat16 not profiled: no bfloat16 arithmetic")
    assert choice.dtype == "float32" and choice.reason.endswith("bfloat16 not profiled: no bfloat16 arithmetic")
    with pytest.raises(ProfileError, match="no profile of an exact dtype"):
        choose_dtype([in_dtype(fp32, "bfloat16", 0.5, tile_width=None)], default_policy())


def test_a_configured_dtype_stays_with_the_profiles_figures_alongside():
    fp32 = synthetic_profile()
    choice = configured("float32", [fp32, in_dtype(fp32, "bfloat16", 0.5)], default_policy())
    assert (choice.dtype, choice.source) == ("float32", "configured")
    assert [o.dtype for o in choice.outlooks] == ["float32", "bfloat16"]
