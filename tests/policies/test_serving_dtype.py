"""The dtype the service serves in: the exact dtype predicted fastest for a lone request, float32
unless another beats it by MIN_GAIN, with the figures in the reason."""

from __future__ import annotations

import pytest

from policies.config import default_policy
from policies.profile import ProfileError
from policies.serving_dtype import MIN_GAIN, choose_dtype, choose_engine, configured, outlook
from tests.policies.profiles import in_dtype, on_llamacpp, synthetic_profile


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


def test_engine_auto_serves_llamacpp_when_faster_and_above_the_quality_floor():
    fp32, policy = synthetic_profile(), default_policy()
    torch_choice = choose_dtype([fp32], policy)
    choice = choose_engine(torch_choice, on_llamacpp(fp32, speed=0.35, agreement=0.97), policy)
    assert (choice.engine, choice.dtype, choice.source) == ("llamacpp", "float32", "measured")
    llama = next(o for o in choice.outlooks if o.engine == "llamacpp")
    assert llama.served == "llama.cpp file" and llama.agreement == 0.97
    assert choice.reason.startswith("llamacpp: llama.cpp file") and "above the quality floor (95%)" in choice.reason
    assert "not the float target's" in choice.reason  # exact to its own weights, said so


@pytest.mark.parametrize(
    ("speed", "agreement", "why"),
    [
        (0.35, 0.72, "not chosen: under the quality floor (95%)"),
        (0.35, None, "its quality against the float target was not measured"),
        (0.99, 0.99, "short of the 1.05× a switch needs"),
    ],
)
def test_engine_auto_keeps_torch_for_weights_under_the_floor_or_a_small_gain(speed, agreement, why):
    fp32, policy = synthetic_profile(), default_policy()
    choice = choose_engine(choose_dtype([fp32], policy), on_llamacpp(fp32, speed, agreement), policy)
    assert (choice.engine, choice.dtype) == ("torch", "float32")
    assert choice.reason.startswith("torch: float32") and why in choice.reason


def test_engine_auto_without_a_llamacpp_profile_says_why():
    fp32, policy = synthetic_profile(), default_policy()
    choice = choose_engine(choose_dtype([fp32], policy), None, policy, "llama-cpp-python is not installed")
    assert choice.engine == "torch" and "llama.cpp not considered: llama-cpp-python is not installed" in choice.reason


def test_engine_auto_keeps_torch_where_llamacpp_wins_alone_but_loses_under_load():
    """Measured here: llama.cpp decoded a lone request 4× faster, but prefilled slower, and a loaded
    service is mostly prefill: the choice reads both, and says so."""
    fp32, policy = synthetic_profile(), default_policy()
    slow_prefill = on_llamacpp(fp32, speed=0.3, agreement=0.97, prefill_speed=40.0)
    choice = choose_engine(choose_dtype([fp32], policy), slow_prefill, policy)
    llama, torch = (next(o for o in choice.outlooks if o.engine == e) for e in ("llamacpp", "torch"))
    assert llama.best_tokens_per_s > MIN_GAIN * torch.best_tokens_per_s
    assert llama.loaded_tokens_per_s < torch.loaded_tokens_per_s / MIN_GAIN
    assert choice.engine == "torch" and "under load (batch 64, prefill included)" in choice.reason
