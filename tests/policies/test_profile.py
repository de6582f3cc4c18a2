import json
import math

import pytest
from pydantic import ValidationError

from policies.profile import ContextCurve, CostCurve, Profile, ProfileError
from tests.policies.profiles import (
    FIXED,
    PER_TOKEN,
    REFERENCE,
    context_curve,
    curve,
    step,
    synthetic_profile,
    with_context,
)


def test_curve_is_exact_at_measured_points_and_log_linear_between():
    c = curve()
    assert c.at(4, 3) == pytest.approx(step(4, 3))
    between = c.at(3, 1)
    share = math.log(3 / 2) / math.log(2)  # how far 3 lies from 2 toward 4, in log(b)
    assert between == pytest.approx(step(2, 1) ** (1 - share) * step(4, 1) ** share)
    assert step(2, 1) < between < step(4, 1)


def test_curve_beyond_the_last_batch_keeps_the_per_sequence_cost():
    c = curve()
    assert c.at(128, 1) == pytest.approx(2 * step(64, 1))
    assert c.at(0.5, 1) == pytest.approx(step(1, 1))  # below one sequence: a lone sequence's step


def test_unmeasured_width_is_a_clear_error():
    with pytest.raises(ProfileError, match="width 12 was not measured"):
        curve().at(1, 12)


def test_prefill_is_interpolated_by_prompt_length():
    prefill = CostCurve(batches=[1], widths=[16, 256], seconds=[[0.1, 0.5]])
    assert prefill.per_token(1, 16) == pytest.approx(0.1)
    assert prefill.per_token(1, 136) == pytest.approx(0.3)
    assert prefill.per_token(1, 512) == pytest.approx(1.0)
    assert prefill.per_token(1, 8) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"batches": [2, 1], "widths": [1], "seconds": [[1.0], [1.0]]}, "strictly increasing"),
        ({"batches": [1, 2], "widths": [1], "seconds": [[1.0]]}, "one row per batch"),
        ({"batches": [1], "widths": [1], "seconds": [[0.0]]}, "positive"),
    ],
)
def test_bad_curves_are_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        CostCurve(**fields)


def test_profile_round_trips_through_json(tmp_path):
    profile = synthetic_profile(quantized_agreement=0.97)
    path = tmp_path / "profiles" / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert not list(path.parent.glob("*.tmp"))


def test_profile_of_another_version_is_refused_with_what_to_do(tmp_path):
    data = json.loads(synthetic_profile().model_dump_json())
    data["version"] = 2
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="another profile version.*specroute profile"):
        Profile.load(path)


def test_missing_or_broken_profiles_say_so(tmp_path):
    with pytest.raises(ProfileError, match="no profile at .*specroute profile"):
        Profile.load(tmp_path / "none.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1}')
    with pytest.raises(ProfileError, match="is not a valid profile"):
        Profile.load(broken)


def test_drafters_and_acceptance_are_found_by_kind_or_name():
    profile = synthetic_profile()
    assert profile.drafter("model").name == "model:draft@bfloat16"
    assert profile.drafter("model:draft@bfloat16").kind == "model"
    assert profile.acceptance_for("copy", "ngram").alpha == 0.8
    assert profile.categories == ["copy", "prose", "sparse"]
    assert profile.proposal_rate("ngram", "sparse") == 0.2
    assert profile.proposal_rate("ngram") == pytest.approx((1 + 1 + 0.2) / 3)  # equal steps per category
    with pytest.raises(ProfileError, match="no drafter 'early-exit'"):
        profile.drafter("early-exit")
    with pytest.raises(ProfileError, match="no acceptance measured for category 'math'"):
        profile.acceptance_for("math", "ngram")


def test_synthetic_curve_matches_its_closed_form():
    assert curve().at(8, 5) == pytest.approx(FIXED + PER_TOKEN * 40)


def test_the_served_quantization_method_is_the_one_the_service_names():
    profile = synthetic_profile(quantized_agreement=0.99)
    other = profile.quantized.model_copy(update={"method": "smoothquant", "agreement": 0.81})
    both = profile.model_copy(update={"quantized_others": [other]})
    assert both.quantized_method("auto").method == "int4-weight-only"  # auto resolved to a weight-only method
    swapped = both.serving("smoothquant")
    assert swapped.quantized.method == "smoothquant" and [q.method for q in swapped.quantized_others] == [
        "int4-weight-only"
    ]
    with pytest.raises(ProfileError, match=r"no quantized backend 'int8-weight-only' measured.*--quantization"):
        both.serving("int8-weight-only")
    w8a8 = synthetic_profile(quantized_agreement=0.8, quantized_method="smoothquant")
    with pytest.raises(ProfileError, match="'auto'"):  # what auto serves was not measured there
        w8a8.serving("auto")


def test_a_seed_written_with_one_quality_still_reads():
    from pathlib import Path

    from policies.profile import AcceptanceSeed

    seed = json.loads((Path(__file__).parents[2] / "profiler/defaults/smollm2-135m-instruct.json").read_text())
    seed["quality"] = {"method": "smoothquant", "agreement": 0.8, "perplexity_delta": 0.15}  # the old shape
    read = AcceptanceSeed.model_validate(seed)
    assert [q.method for q in read.quality] == ["smoothquant"] and read.quality_of("smoothquant").agreement == 0.8
    assert read.quality_of("int4-weight-only") is None


def test_context_scales_a_pass_by_what_was_measured_at_that_context():
    context = context_curve()
    profile = synthetic_profile().model_copy(update={"context": context})
    for b, w, n in [(1, 1, 64), (4, 5, 512), (16, 9, 2048), (64, 1, 192)]:  # measured points
        assert profile.pass_seconds(b, w, n) == pytest.approx(with_context(b, w, n))
    assert context.factor(8, 3, REFERENCE) == pytest.approx(1.0)  # the curve's own context: unscaled
    assert profile.pass_seconds(8, 3, None) == profile.target.at(8, 3)
    # Linear in context and in width between measured ones (the synthetic cost is linear in both).
    assert profile.pass_seconds(16, 3, 1000) == pytest.approx(with_context(16, 3, 1000))
    # Past the longest context, along the last segment's slope.
    assert profile.pass_seconds(16, 1, 4096) == pytest.approx(with_context(16, 1, 4096))
    # A long context makes a wide pass relatively cheaper: v(b, k) falls.
    v = [profile.pass_seconds(16, 9, n) / profile.pass_seconds(16, 1, n) for n in (64, 512, 2048)]
    assert v == sorted(v, reverse=True) and v[0] > v[-1] * 1.2


def test_context_between_measured_batches_is_interpolated_in_log_batch():
    context = context_curve(batches=[1, 4])
    low, high = context.factor(1, 1, 2048), context.factor(4, 1, 2048)
    assert context.factor(2, 1, 2048) == pytest.approx((low + high) / 2)
    assert context.factor(64, 1, 2048) == pytest.approx(high)  # beyond the largest measured batch


def test_cells_left_out_by_the_budget_are_skipped():
    full = context_curve(batches=[1, 2, 4])
    seconds = [row[:] for row in full.seconds]
    seconds[2] = [seconds[2][0], [None, None, None], [None, None, None], [None, None, None]]  # batch 4: one context
    partial = ContextCurve(**(full.model_dump() | {"seconds": seconds}))
    assert partial.factor(4, 1, 2048) == pytest.approx(full.factor(2, 1, 2048))  # batch 4 unusable: batch 2's
    assert partial.factor(2, 1, 2048) == pytest.approx(full.factor(2, 1, 2048))


@pytest.mark.parametrize(
    "update,message",
    [
        ({"contexts": [512, 64, 192, 2048]}, "contexts must be positive and strictly increasing"),
        ({"seconds": [[[0.1, 0.1, 0.1]]]}, "seconds must be batches × contexts × widths"),
    ],
)
def test_bad_context_curves_are_refused(update, message):
    fields = context_curve().model_dump() | update
    with pytest.raises(ValidationError, match=message):
        ContextCurve(**fields)


def test_a_context_curve_with_no_batch_at_two_contexts_is_refused():
    fields = context_curve(batches=[1], contexts=[64, 192]).model_dump()
    fields["seconds"] = [[[0.1, 0.2, 0.3], [None, None, None]]]
    with pytest.raises(ValidationError, match="no batch has two measured contexts"):
        ContextCurve(**fields)


def probe_of(profile: Profile) -> Profile:
    """`profile` as a quick probe measures it: the target at batches 1 and 2 only, no context curve."""
    target = profile.target
    curve = CostCurve(batches=target.batches[:2], widths=target.widths, seconds=target.seconds[:2])
    return profile.model_copy(update={"target": curve, "context": None, "provisional": True})


def test_a_profile_written_before_provisional_existed_reads_as_a_full_one(tmp_path):
    data = json.loads(synthetic_profile().model_dump_json())
    del data["provisional"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    loaded = Profile.load(tmp_path / "old.json")
    assert loaded.provisional is False and loaded.provisional_reason() is None


def test_a_provisional_profile_says_what_it_measured_and_what_is_extrapolated(tmp_path):
    probe = probe_of(synthetic_profile(quantized_agreement=0.97))
    probe.save(tmp_path / "probe.json")
    assert Profile.load(tmp_path / "probe.json").provisional
    reason = probe.provisional_reason()
    assert reason is not None and reason.startswith("costs from a provisional profile (a quick probe: ")
    assert "target passes at batches 1, 2 (larger ones extrapolated)" in reason
    assert "no context curve" in reason and "prefill at 16, 256 tokens" in reason
    assert "int4-weight-only at batches 1 to 64 (7 sizes)" in reason
    # Past its last measured batch the curve keeps batch 2's cost per sequence.
    assert math.isclose(probe.pass_seconds(8, 1), 4 * probe.target.at(2, 1))


def test_a_provisional_profile_may_leave_the_quantized_backend_to_the_full_run():
    probe = probe_of(synthetic_profile())
    assert probe.serving("auto") is probe and "no quantized backend measured" in probe.coverage()
    with pytest.raises(ProfileError, match="no quantized backend 'auto' measured"):
        synthetic_profile().serving("auto")


def test_serving_drops_the_quantized_acceptance_of_drafters_the_backend_does_not_load():
    profile = synthetic_profile(quantized_agreement=0.99, quantized_alphas={"copy": 0.7})
    assert profile.serving("int4-weight-only").quantized.acceptance  # as measured
    assert profile.serving("int4-weight-only", ["ngram"]).quantized.acceptance
    served = profile.serving("int4-weight-only", [])
    assert served.quantized.acceptance == [] and served.quantized.curve == profile.quantized.curve
