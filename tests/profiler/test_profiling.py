"""A small real profile of the embedded model (prompt lookup, every prompt of the set, short
answers), shared by the tests of the profiler, the α predictor on real data, advise and model-fit;
the same profile again with its acceptance shipped rather than measured; and the shipped EAGLE head
profiled on the categories whose answers copy nothing (where it has to pay)."""

import json
import math

import pytest

from backends.quantized import resolve_method
from backends.speculative.engine import SpeculativeEngine
from backends.speculative.factory import build_drafter
from policies.drafters import SERVED_KINDS, DrafterConfig
from policies.profile import AcceptanceSeed, Profile, ProfileError
from profiler import profiling
from profiler.bench_model_fit import ModelFitConfig, render_model_fit, run_model_fit
from profiler.predictor import AlphaPredictor
from profiler.profile_report import render_profile
from profiler.profiling import (
    PROBE_PROMPTS,
    ProfileConfig,
    default_profile_path,
    quick_config,
    run_profile,
    seed_fits,
    seed_path,
    usable_seed,
    write_seed,
)
from profiler.workloads import load_prompt_set
from router.advise import Predictors
from router.cli import main

# One worker runs the module: its fixtures measure a real profile, which two workers would each measure.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("profiling")]

COPYING = ("summarization", "rag", "translation", "code")
FREE = ("chat", "math", "qa")


SMALL = ProfileConfig(
    batches=[1, 2],
    max_width=4,
    prefill_lengths=[8, 32],
    contexts=[64, 512],
    drafters=["ngram"],
    acceptance_k=3,
    max_tokens=24,
    repeats=2,  # best of two tries a pass, in one sweep: model-fit's 1/3–3× bounds are the tightest reading
    curve_sweeps=1,
    quality_tokens=8,
    quality_prompts=1,  # of 5 a category: 7 prompts, ~1,200 teacher-forced positions (the quality test's floor holds)
    training_prompts=2,
)
# A trained drafter on the prompts where lookup rarely proposes, with the settings above: its
# numbers compare with prompt lookup's on the same prompts (greedy answers do not depend on the
# drafter). The copying categories' long prompts would triple its cost and tell these tests nothing.
EAGLE = SMALL.model_copy(
    update={
        "drafters": ["eagle"],
        "categories": list(FREE),
        "quantization": [],
        "context_budget_s": 0.0,
        "training_prompts": 0,
        "repeats": 1,  # its cost curves are the profile's above again: only its drafter is read
        "curve_sweeps": 1,
    }
)
TRAINING_CATEGORIES = ["chat", "code", "math", "qa"]  # the training set's (backends.training.prompts)


# The same acceptance settings with the seed standing in; how the costs are timed is no part of
# what a seed must match, so one quick sweep of the curves will do.
SHIPPED = SMALL.model_copy(update={"acceptance": "shipped", "repeats": 1, "curve_sweeps": 1, "context_budget_s": 0.0})


@pytest.fixture(scope="module")
def profile(loaded) -> Profile:
    return run_profile(SMALL, progress=False, log=lambda _: None)


@pytest.fixture(scope="module")
def eagle_profile(loaded) -> Profile:
    return run_profile(EAGLE, progress=False, log=lambda _: None)


@pytest.fixture(scope="module")
def seeds(profile, tmp_path_factory):
    """The fixture profile's acceptance, shipped as a seed in a folder of its own."""
    folder = tmp_path_factory.mktemp("seeds")
    write_seed(profile, seed_path(profile.model.name, folder))
    return folder


@pytest.fixture(scope="module")
def shipped(loaded, seeds) -> tuple[Profile, list[str]]:
    """The same settings profiled again with the seed standing in; nothing may measure acceptance."""
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiling, "SEEDS_DIR", seeds)
        patch.setattr(profiling, "measure_acceptance", lambda *a: pytest.fail("acceptance was measured"))
        patch.setattr(profiling, "measure_quality", lambda *a: pytest.fail("int8 quality was measured"))
        patch.setattr(profiling, "training_set", lambda *a: pytest.fail("training-set acceptance was measured"))
        profile = run_profile(SHIPPED, progress=False, log=lines.append)
    return profile, lines


@pytest.fixture(scope="module")
def profile_path(profile, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    profile.save(path)
    return path


def test_profile_records_what_it_measured_on(profile):
    assert profile.model.name == "SmolLM2-135M-Instruct" and profile.model.dtype == "float32"
    assert profile.machine["cpu"] and profile.libraries["torch"] and profile.settings["acceptance_k"] == 3
    assert profile.target.batches == [1, 2] and profile.target.widths == [1, 2, 3, 4]
    assert all(s > 0 for row in profile.target.seconds for s in row)
    assert profile.prefill.widths == [8, 32]
    context = profile.context
    assert context is not None and context.reference == 192 and context.contexts == [64, 192, 512]
    assert context.batches == [1, 2] and context.widths == [1, 3, 4]
    assert all(s is not None and s > 0 for row in context.seconds for cell in row for s in cell)
    assert context.factor(2, 4, 192) == pytest.approx(1.0)
    assert [d.name for d in profile.drafters] == ["ngram"]


def test_the_quantized_backend_is_measured_for_speed_memory_and_quality(profile):
    q = profile.quantized
    assert q is not None and q.method == "int4-weight-only"  # auto, on the embedded Q4_1 checkpoint
    assert q.curve.batches == [1, 2] and q.curve.widths == [1] and all(s[0] > 0 for s in q.curve.seconds)
    # On the held-out half of the prompt set (32 tokens a prompt: 0.990 teacher-forced, 86 % identical greedy).
    assert 0.95 < q.agreement <= 1 and q.perplexity_delta is not None and abs(q.perplexity_delta) < 0.01
    assert q.greedy_match is not None and 0.5 <= q.greedy_match <= 1
    assert q.weight_bytes is not None and q.weight_bytes < profile.model.weight_bytes / 2
    assert q.max_weight_error is not None and q.max_weight_error < 0.05
    assert "quantized backend int4-weight-only (served)" in render_profile(profile)


def test_acceptance_covers_every_category_and_prompt(profile):
    prompt_set = load_prompt_set()
    assert profile.categories == sorted(prompt_set.categories)
    prompts = sum(len(c.prompts) for c in prompt_set.categories.values())
    assert len(profile.project_samples) == prompts * len(profile.drafters)  # one sample per prompt and drafter
    for a in profile.acceptance:
        assert 0 <= a.alpha <= 1 and a.judged_tokens >= a.accepted_tokens
        assert a.accepted_per_position == sorted(a.accepted_per_position, reverse=True)  # survival only falls
        assert 0 <= a.proposal_rate <= 1 and a.drafts <= a.steps
        # Every accepted token is counted at its position: per-position shares add up to tokens per step.
        assert a.tokens_per_step == pytest.approx(1 + sum(a.accepted_per_position))


def test_training_set_samples_feed_the_predictor_only(profile):
    """`training_prompts` prompts of each training-set category per drafter, marked as such: the
    predictor is fitted and scored on them too, while the profile's per-category α and prompt
    lengths stay those of the profiled set."""
    training = [s for s in profile.samples if s.prompt_set == "training"]
    for drafter in profile.drafters:
        mine = [s for s in training if s.drafter == drafter.name]
        assert sorted(s.category for s in mine) == sorted(TRAINING_CATEGORIES * SMALL.training_prompts)
        assert len({s.prompt_id for s in mine}) == len(mine) and all(s.judged_tokens >= s.accepted_tokens for s in mine)
    project = profile.project_samples
    for a in profile.acceptance:
        rows = [s for s in project if s.category == a.category and s.drafter == a.drafter]
        assert a.judged_tokens == sum(s.judged_tokens for s in rows)
    chat = [s.prompt_tokens for s in project if s.category == "chat"]
    assert profile.mean_prompt_tokens("chat") == round(sum(chat) / len(chat))
    for score in profile.predictor:  # scored on every sample with evidence, of both prompt sets
        mine = [s for s in profile.samples if s.drafter == score.drafter]
        scored = [s for s in mine if (s.judged_tokens if score.target == "alpha" else s.requested_steps) > 0]
        assert score.samples == len(scored) > len([s for s in scored if s.prompt_set == "project"])
    per_drafter, training = len(project) // len(profile.drafters), len(TRAINING_CATEGORIES) * SMALL.training_prompts
    expected = f"{per_drafter} prompts of the profiled set and {training} of the training set per drafter"
    assert expected in render_profile(profile)


def test_training_set_draws_a_fixed_spread_of_the_covered_categories():
    picked = profiling.training_set(SMALL.model_copy(update={"training_prompts": 5, "categories": ["code", "rag"]}))
    assert list(picked) == ["code"] and len(picked["code"]) == 5  # rag has no training-set prompts
    assert len({p.topic for p in picked["code"]}) > 1  # a random draw, not the first topic's prompts
    assert picked == profiling.training_set(SMALL.model_copy(update={"training_prompts": 5, "categories": ["code"]}))


def test_a_seed_without_training_set_samples_has_them_measured(loaded, profile, seeds):
    """A seed without the drafter's training-set samples, or of another count, cannot stand in for
    the training set: it is measured with the profile's engine; a seed that has them gives its own."""
    engine = SpeculativeEngine(loaded, build_drafter(DrafterConfig().of("ngram"), loaded), k=SMALL.acceptance_k)
    seed = AcceptanceSeed.load(seed_path(profile.model.name, seeds))
    from_seed = profiling.training_samples(engine, SMALL, seed, progress=False)
    assert from_seed == [s for s in profile.samples if s.drafter == "ngram" and s.prompt_set == "training"]
    # A seed of the same count without this drafter's training-set samples (e.g. a drafter it never
    # shipped them for) is no answer either; one of another count or of none is the same case.
    bare = seed.model_copy(
        update={
            "settings": {**seed.settings, "training_prompts": 1},
            "samples": [s for s in seed.samples if s.prompt_set == "project"],
        }
    )
    measured = profiling.training_samples(engine, SMALL.model_copy(update={"training_prompts": 1}), bare, False)
    assert sorted(s.category for s in measured) == TRAINING_CATEGORIES and all(
        s.prompt_set == "training" for s in measured
    )
    assert {s.prompt_id for s in measured} <= {s.prompt_id for s in from_seed}  # the same draw, cut shorter
    assert profiling.training_samples(engine, SMALL.model_copy(update={"training_prompts": 0}), None, False) == []


def test_prompt_lookup_accepts_more_where_answers_copy_the_prompt(profile):
    def mean_alpha(categories):
        return sum(profile.acceptance_for(c, "ngram").alpha for c in categories) / len(categories)

    assert mean_alpha(COPYING) > mean_alpha(FREE)


def test_a_trained_drafter_is_profiled_like_any_other_and_pays_where_lookup_cannot(profile, eagle_profile):
    """The shipped EAGLE head gets acceptance per category and a measured draft cost; on answers
    that copy nothing it advances more tokens per step than prompt lookup, which rarely proposes."""
    (eagle,) = eagle_profile.drafters
    assert eagle.kind == "eagle" and all(s > 0 for s in eagle.step_seconds) and eagle.calibration
    assert eagle_profile.categories == sorted(FREE) and eagle_profile.context is None
    assert all(a.gamma > 0 for a in eagle_profile.acceptance)

    def mean_tokens_per_step(measured, drafter):
        return sum(measured.acceptance_for(c, drafter).tokens_per_step for c in FREE) / len(FREE)

    assert all(eagle_profile.acceptance_for(c, "eagle").proposal_rate == 1.0 for c in FREE)  # it always drafts
    assert mean_tokens_per_step(eagle_profile, "eagle") > mean_tokens_per_step(profile, "ngram") + 0.1


def test_alpha_predictor_beats_a_constant_on_held_out_prompts(profile):
    alpha, rho = [p for p in profile.predictor if p.drafter == "ngram"]
    assert (alpha.target, rho.target) == ("alpha", "proposal_rate")
    assert alpha.mae_with_category < alpha.mae_constant
    assert alpha.mae_text_only < alpha.mae_constant
    assert rho.mae_with_category < rho.mae_constant


def test_each_drafter_gets_an_acceptance_map_fitted_on_its_runs_and_scored_out_of_fold(profile, eagle_profile):
    from backends.speculative.acceptance import CONFIDENCE_FEATURES, NGRAM_FEATURES

    maps = {m.drafter: m for m in profile.acceptance_maps + eagle_profile.acceptance_maps}
    assert [m.drafter for m in profile.acceptance_maps] == ["ngram"] and set(maps) == {"ngram", "eagle"}
    assert maps["ngram"].features == list(NGRAM_FEATURES) and maps["eagle"].features == list(CONFIDENCE_FEATURES)
    for m in maps.values():
        assert m.samples > 50 and m.prompts > 7  # every judged position of the fixed-k runs, by prompt
        assert m.brier is not None and m.brier < 0.3 and sum(b.count for b in m.reliability) == m.samples
    # Prompt lookup's match features tell good proposals from bad ones better than a constant.
    assert maps["ngram"].brier < maps["ngram"].brier_constant
    report = render_profile(profile)
    assert "per-proposal acceptance maps" in report
    assert f"ngram: {maps['ngram'].samples} positions from {maps['ngram'].prompts} prompts" in report


def test_profile_round_trips_and_refits_the_same_predictor(profile, profile_path):
    loaded = Profile.load(profile_path)
    assert loaded == profile
    text = "Summarize this passage: " + "The river floods every spring. " * 5
    first = AlphaPredictor.from_profile(profile).predict(text, 1, 60, "ngram")
    again = AlphaPredictor.from_profile(loaded).predict(text, 1, 60, "ngram")
    assert first == again


def test_report_shows_curves_scaling_and_acceptance(profile):
    report = render_profile(profile)
    for section in (
        "target pass t(b, n)",
        "v(b, k)",
        "decode step by concurrency",
        "prefill",
        "drafters:",
        "α and ρ predictors",
    ):
        assert section in report
    assert "acceptance: measured" in report
    lines = report.splitlines()
    a = profile.acceptance_for("summarization", "ngram")
    row = next(line for line in lines if line.split()[:2] == ["summarization", "ngram"])
    assert row.split()[2:6] == ["3", f"{a.proposal_rate:.2f}", f"{a.alpha:.2f}", f"{a.acceptance_rate:.2f}"]
    prefill = next(line for line in lines if line.startswith("prefill"))
    assert f"32 tokens {profile.prefill.seconds[0][1] * 1e3:.0f} ms" in prefill
    target = next(line for line in lines if line.split()[:1] == ["1"] and len(line.split()) == 5)
    assert target.split()[1:] == [f"{s * 1e3:.1f}" for s in profile.target.seconds[0]]


def test_advise_runs_on_a_real_profile(capsys, profile_path):
    prompt = "Translate to French: " + load_prompt_set().categories["translation"].prompts[0].messages[-1].content
    code = main(["advise", prompt, "--concurrency", "2", "--profile", str(profile_path), "--json"])
    advice = json.loads(capsys.readouterr().out)
    # int4 weight-only measures above the 0.95 floor and faster than float32, so it may serve: faster, or because
    # float32 misses the TPOT SLO on this run's measurement (a loaded machine), the reason says which.
    assert code == 0 and advice["backend"] in {"speculative", "plain", "quantized"}
    if advice["backend"] == "quantized":
        [reason] = [r for r in advice["reasons"] if r.startswith("quantization")]
        assert "int4-weight-only at" in reason and reason.endswith("→ quantized backend"), reason
        assert "≥ floor 95.0%" in reason or "misses the TPOT SLO" in reason, reason
    quantized = next(b for b in advice["backends"] if b["backend"] == "quantized")
    assert quantized["weights"] == "int4-weight-only" and quantized["agreement"] > 0.95
    spec = next(c for c in advice["candidates"] if c["backend"] == "speculative")
    assert spec["drafter"] == "ngram" and 1 <= spec["k"] <= 3 and spec["alpha"] is not None
    assert advice["features"]["prompt_tokens"] > 20


# A category whose answers copy from the prompt (prompt lookup drafts), with short held-out prompts:
# model-fit prefills its prompt once per engine, batch and warm-up.
FIT_CATEGORY = "translation"


def test_model_fit_sets_measured_against_predicted(profile_path):
    config = ModelFitConfig(
        profile=str(profile_path),
        categories=[FIT_CATEGORY],
        ks=[1, 3],
        batches=[1, 2],
        max_tokens=16,
        prompts_per_category=1,
        predictor_prompts=1,
        repeats=1,  # one run of each engine per cell: the ratios below are loose enough for one
    )
    report = run_model_fit(config, progress=False)
    assert [(p.batch, p.k) for p in report.points] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(p.identical for p in report.points)  # lossless: every row equals plain decoding
    for p in report.points:
        assert p.measured == pytest.approx(p.spec_tokens_per_s / p.plain_tokens_per_s)
        assert 0 <= p.alpha <= 1 and 0 <= p.proposal_rate <= 1
        assert 1 / 3 < p.predicted / p.measured < 3  # loose: a few steps per row on a noisy machine
    assert math.isfinite(report.mape) and report.break_even[0].category == FIT_CATEGORY
    # Held-out prompts, costs read at each cell's context, predictions from the predictor per prompt.
    held_out = load_prompt_set("heldout").categories[FIT_CATEGORY].prompts[0]
    assert [p.prompt_id for p in report.prompts] == [held_out.id] and report.prompts[0].prompt_tokens > 100
    assert all(p.context == pytest.approx(report.prompts[0].prompt_tokens + 8) for p in report.points)
    assert all(p.predicted_prompt is not None and 0 <= (p.alpha_predicted or 0) <= 1 for p in report.points)
    assert [g.name for g in report.by_batch] == ["b=1", "b=2"] and report.by_category[0].cells == 4
    assert [f.target for f in report.predictor] == ["alpha", "proposal_rate"]
    assert [(r.category, r.batch) for r in report.routing] == [(FIT_CATEGORY, 1), (FIT_CATEGORY, 2)]
    # The speculative backend as served (auto k) beside plain, and the policy's backend per prediction.
    assert [(s.batch, s.identical) for s in report.served] == [(1, True), (2, True)]
    for served, route in zip(report.served, report.backend_routing, strict=True):
        assert route.served == served.measured and route.best in ("speculative", "plain")
        assert set(route.chosen) == {"predicted", "profile", "run"} and all(0 <= x < 1 for x in route.loss.values())
    # The predictor is scored on answers as long as the profile's, and their second halves.
    fit = report.prompts[0]
    assert fit.judged_tokens + fit.judged_tokens_rest > 0 and 0 <= fit.alpha_rest <= 1
    assert fit.requested_steps + fit.requested_steps_rest <= 2 * SMALL.max_tokens
    assert (fit.alpha_online, fit.proposal_rate_online) == (fit.alpha_predicted, fit.proposal_rate_predicted)  # first
    text = render_model_fit(report)
    assert f"mean absolute percentage error: {report.mape:.1f}% (prediction from the run's α)" in text
    assert "per-prompt predictor (1 per category of the heldout prompts" in text
    assert "the speculative backend as served" in text and "routing on a prediction to a backend" in text
    first = report.points[0]
    row = next(line for line in text.splitlines() if line.split()[:3] == [FIT_CATEGORY, "1", "1"])
    assert f"{first.measured:.2f}×" in row and f"{first.predicted:.2f}×" in row and row.endswith("yes")


def test_profile_command_writes_where_it_says(capsys, tmp_path):
    path = tmp_path / "p.json"
    args = [
        "profile",
        "--batches",
        "1,2",
        "--max-width",
        "2",
        "--prefill-lengths",
        "8",
        "--drafters",
        "ngram",
        "--acceptance-k",
        "1",
        "--contexts",
        "64",  # the context curve at one length (the default grid is timed for up to 150 s)
        "--training-prompts",
        "1",  # of the training set's chat prompts (100 by default)
        "--categories",
        "chat",
        "--prompts",
        "2",
        "--max-tokens",
        "4",
        "--quantization",
        "none",  # the quantized backend's quality pass is what the profile fixture above checks
        "--out",
        str(path),
    ]
    assert main(args) == 0
    assert f"profile written to {path}" in capsys.readouterr().out
    written = Profile.load(path)
    assert written.categories == ["chat"] and written.context is not None and written.context.contexts == [64, 192]
    assert [s.prompt_set for s in written.samples] == ["project", "project", "training"]


def test_default_profile_path_is_per_model_under_specroute_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    assert default_profile_path() == tmp_path / "profiles" / "embedded-float32-cpu.json"
    assert default_profile_path("/models/My Model/", "bfloat16", "cuda").name == "models_My_Model-bfloat16-cuda.json"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batches", "4,2"], "batches must be positive and strictly increasing"),
        (["--acceptance-k", "9", "--max-width", "4"], "acceptance_k (9) needs max_width ≥ 10"),
        (["--categories", "poetry"], "unknown categories ['poetry'] (the prompt set has chat, code"),
    ],
)
def test_profile_command_refuses_bad_settings(capsys, tmp_path, args, message):
    assert main(["profile", *args, "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid profile settings:") and message in err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batches", "0,2"], "batches: Value error, must be positive and strictly increasing"),
        (["--ks", "4,2"], "ks: Value error, must be positive and strictly increasing"),
        (["--categories", "poetry"], "unknown categories ['poetry']"),
    ],
)
def test_model_fit_refuses_bad_settings_before_measuring(capsys, args, message):
    assert main(["bench", "model-fit", *args, "--out", "-"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid model-fit settings:") and message in err


def test_shipped_acceptance_stands_in_for_measuring_it(profile, shipped):
    """Acceptance, samples, predictors and int8 agreement come from the seed; every cost is measured
    again, and γ (a cost) too, in the short timing run."""
    seeded, lines = shipped
    strip = {"gamma"}
    assert [a.model_dump(exclude=strip) for a in seeded.acceptance] == [
        a.model_dump(exclude=strip) for a in profile.acceptance
    ]
    assert seeded.samples == profile.samples and seeded.predictor == profile.predictor
    assert seeded.settings["repeats"] == 1 and seeded.context is None  # its own timing settings
    assert seeded.quantized.agreement == profile.quantized.agreement
    assert all(s > 0 for row in seeded.quantized.curve.seconds for s in row)
    assert [d.name for d in seeded.drafters] == ["ngram"]
    assert all(s > 0 for s in seeded.drafter("ngram").step_seconds)
    assert all(a.gamma > 0 for a in seeded.acceptance)
    assert seeded.acceptance_source.startswith(
        "shipped with specroute: acceptance of ngram and int4-weight-only quality"
    )
    assert any("measuring only this machine's costs" in line for line in lines)
    assert f"acceptance: {seeded.acceptance_source}" in render_profile(seeded)


def test_a_seed_of_other_weights_or_settings_is_measured_instead(loaded, profile, seeds, tmp_path, monkeypatch):
    path = seed_path(profile.model.name, seeds)
    seed = AcceptanceSeed.load(path)
    seed.model_copy(update={"fingerprint": "0" * 64}).save(seed_path(profile.model.name, tmp_path))
    monkeypatch.setattr(profiling, "SEEDS_DIR", tmp_path)
    lines: list[str] = []
    assert usable_seed(loaded, SMALL, lines.append) is None
    assert lines == [
        "measuring acceptance too: it was measured on another SmolLM2-135M-Instruct (the weights' fingerprint differs)"
    ]
    with pytest.raises(ProfileError, match="cannot use shipped acceptance: .*fingerprint differs"):
        usable_seed(loaded, SMALL.model_copy(update={"acceptance": "shipped"}), lines.append)
    monkeypatch.setattr(profiling, "SEEDS_DIR", seeds)
    assert usable_seed(loaded, SMALL.model_copy(update={"max_tokens": 32}), lines.append) is None
    assert lines[-1] == "measuring acceptance too: it was measured with other max_tokens"
    assert usable_seed(loaded, SMALL.model_copy(update={"acceptance": "measure"}), lines.append) is None
    # Shipped int8/int4 quality stands in only when read over the same prompts and tokens.
    method = resolve_method(loaded, "auto")
    assert profiling._shipped_quality(seed, SMALL, method) is not None
    for update in ({"quality_prompts": None}, {"quality_tokens": 16}):
        assert profiling._shipped_quality(seed, SMALL.model_copy(update=update), method) is None, update
    # ... or over more prompts than asked (a probe reads one a category; what ships read them all)
    every = seed.model_copy(update={"settings": {**seed.settings, "quality_prompts": None}})
    assert profiling._shipped_quality(every, SMALL, method) == seed.quality_of(method)


def test_only_a_measured_profile_of_the_embedded_default_ships(profile, shipped, tmp_path):
    other = profile.model_copy(update={"model": profile.model.model_copy(update={"name": "Other-1B"})})
    with pytest.raises(ProfileError, match="acceptance ships only for the embedded default in float32 or bfloat16"):
        write_seed(other, tmp_path / "seed.json")
    with pytest.raises(ProfileError, match="needs acceptance measured in this run: add --acceptance measure"):
        write_seed(shipped[0], tmp_path / "seed.json")
    assert not (tmp_path / "seed.json").exists()


def test_the_shipped_seed_lets_a_first_start_skip_acceptance(loaded):
    """What ships in the package fits the service's first start: the default settings and every
    drafter the service loads by default, for these very weights."""
    config = ProfileConfig()
    seed = usable_seed(loaded, config, lambda _: None)
    assert seed is not None and seed.dtype == "float32"
    for kind in SERVED_KINDS:
        drafter = build_drafter(DrafterConfig().of(kind), loaded)
        assert seed_fits(seed, config, kind, drafter.name), kind
    assert all(seed.quality_of(resolve_method(loaded, choice)) for choice in config.quantization)
    assert {a.category for a in seed.acceptance} == set(load_prompt_set().categories)
    # a first start on llama.cpp takes its file's and its quantized backend's quality from here
    probe = quick_config(ProfileConfig(engine="llamacpp"))
    for method in ("llamacpp-file", "llamacpp-Q8_0"):
        assert profiling._shipped_quality(seed, probe, method) is not None, method


def test_the_shipped_bfloat16_seed_lets_a_bfloat16_first_start_skip_acceptance(loaded_bf16):
    """The bfloat16 profile a `dtype: auto` first start measures (no quantized backend of its own,
    the draft model weight-only under the bfloat16 target) takes its acceptance from the package."""
    config = ProfileConfig(dtype="bfloat16", quantization=[])
    seed = usable_seed(loaded_bf16, config, lambda _: None)
    assert seed is not None and seed.dtype == "bfloat16"
    for kind in SERVED_KINDS:
        drafter = build_drafter(DrafterConfig().of(kind), loaded_bf16)
        assert seed_fits(seed, config, kind, drafter.name), kind
    assert "model:SmolLM2-135M-Instruct@int4-weight-only" in {d.name for d in seed.drafters}
    assert {a.category for a in seed.acceptance} == set(load_prompt_set().categories)


def test_a_quick_probe_is_a_provisional_profile_the_router_can_route_with(loaded):
    """Nothing ships for these settings: the probe measures acceptance on a few prompts a category,
    every pass in one sweep, no context curve, no quantized backend, and is marked provisional."""
    lines: list[str] = []
    short = SMALL.model_copy(update={"drafters": ["ngram"], "categories": ["chat", "math"]})  # short prompts
    probe = run_profile(quick_config(short), progress=False, log=lines.append)
    assert probe.provisional and probe.settings["probe"] is True
    assert probe.target.batches == [1, 2] and probe.context is None and probe.prefill.widths == [64]
    assert probe.quantized is None and probe.serving("auto") is probe
    assert probe.predictor == []  # cross-validation scores are for the report: left to the full run
    assert probe.settings["prompts_per_category"] == PROBE_PROMPTS and probe.settings["training_prompts"] == 0
    assert any("the probe measures acceptance on" in line for line in lines)
    assert len(probe.samples) == PROBE_PROMPTS * 2 and probe.categories == ["chat", "math"]
    assert len(probe.acceptance_maps) == 1  # acceptance was measured in a run: its map comes with it
    Predictors.from_profile(probe)  # the router refits its predictors from so few samples


LLAMACPP = {"engine": "llamacpp", "categories": ["chat", "math"], "training_prompts": 0, "context_budget_s": 0.0}


@pytest.fixture(scope="module")
def llamacpp_profile() -> tuple[Profile, list[str]]:
    from backends.engines.llamacpp import llama_unavailable

    if llama_unavailable() is not None:
        pytest.skip("llama-cpp-python is not installed here (`make install` builds it)")
    config = {k: v for k, v in SMALL.model_dump().items() if k != "drafters"}  # the engine's default drafters
    lines: list[str] = []
    return run_profile(ProfileConfig.model_validate({**config, **LLAMACPP}), progress=False, log=lines.append), lines


def test_a_llamacpp_profile_measures_that_engine_and_its_weights_quality(llamacpp_profile, profile):
    """On llama.cpp: its own passes, prefill and acceptance (the shipped float32 acceptance is not
    its model's), the served weights' quality against the float target, and the quantized backend
    as the file requantized to Q8_0."""
    llama, lines = llamacpp_profile
    m = llama.model
    assert (m.engine, m.gguf_weights, m.served) == ("llamacpp", "file", "llama.cpp file")
    assert m.exact_at_batch_one and m.tile_width is None
    assert m.quality is not None and m.quality.method == "llamacpp-file" and 0.8 <= m.quality.agreement <= 1
    assert m.kv_bytes_per_token is not None and m.kv_bytes_per_token < profile.model.kv_bytes_per_token / 3  # Q8_0
    assert llama.target.batches == [1, 2] and llama.target.widths == [1, 2, 3, 4]
    one = llama.target.seconds[0]
    assert all(s > 0 for s in one) and one[3] > 1.2 * one[0]  # verifying 3 drafts is no free lunch here
    assert llama.context is None and llama.prefill.widths == [8, 32]
    assert [d.kind for d in llama.drafters] == ["ngram"]  # a torch draft model is not loaded by default
    assert {a.category for a in llama.acceptance} == {"chat", "math"} and llama.acceptance_source == "measured"
    assert any("measuring acceptance on llamacpp" in line for line in lines)
    q = llama.quantized
    assert q is not None and q.method == "llamacpp-Q8_0"
    # stacked with prompt lookup (the engine's default): its verify passes timed, α on its own tokens
    assert q.curve.widths == [1, 2, 3, 4] and q.tile_width is None
    assert {(a.category, a.drafter) for a in q.acceptance} == {("chat", "ngram"), ("math", "ngram")}
    assert all(a.judged_tokens > 0 for a in q.acceptance)
    assert q.weight_bytes is not None and q.weight_bytes > m.weight_bytes  # 8 bits a weight against the file's ~4.5
    assert llama.serving("llamacpp-Q8_0").quantized == q


def test_a_llamacpp_profiles_weights_quality_ships_beside_the_float32_seed(llamacpp_profile, profile, seeds, tmp_path):
    llama, _ = llamacpp_profile
    path = tmp_path / "seed.json"
    path.write_bytes(seed_path(profile.model.name, seeds).read_bytes())
    assert write_seed(llama, path) == path
    seed = AcceptanceSeed.load(path)
    served, q8 = seed.quality_of("llamacpp-file"), seed.quality_of("llamacpp-Q8_0")
    assert served is not None and q8 is not None
    assert served.agreement == llama.model.quality.agreement and served.measured_on
    assert seed.acceptance == AcceptanceSeed.load(seed_path(profile.model.name, seeds)).acceptance  # untouched
    write_seed(profile, path)  # torch's acceptance shipped again keeps them
    assert AcceptanceSeed.load(path).quality_of("llamacpp-file") == served
    other = llama.model_copy(update={"settings": {**llama.settings, "quality_tokens": 16}})
    with pytest.raises(ProfileError, match="measured with other quality_tokens"):
        write_seed(other, path)


def test_a_llamacpp_probe_takes_its_weights_shipped_quality(llamacpp_profile, profile, seeds, tmp_path, monkeypatch):
    """A first start on llama.cpp skips measuring its weights' quality where it ships (the slowest
    part of its probe); the full profile measures it on the machine."""
    llama, _ = llamacpp_profile
    path = seed_path(profile.model.name, tmp_path)
    path.write_bytes(seed_path(profile.model.name, seeds).read_bytes())
    write_seed(llama, path)
    monkeypatch.setattr(profiling, "SEEDS_DIR", tmp_path)
    config = {k: v for k, v in SMALL.model_dump().items() if k != "drafters"}
    probe = run_profile(
        quick_config(ProfileConfig.model_validate({**config, "engine": "llamacpp"})), progress=False, log=print
    )
    assert probe.model.quality == AcceptanceSeed.load(path).quality_of("llamacpp-file")
    assert "llamacpp-file quality" in probe.acceptance_source and probe.provisional


def test_a_llamacpp_profile_has_a_path_of_its_own():
    config = ProfileConfig.model_validate(LLAMACPP)
    path = default_profile_path("embedded", "float32", "cpu", config.loop())
    assert path.name == "embedded-llamacpp-file-cpu.json"
    assert path != default_profile_path("embedded", "float32", "cpu")
    with pytest.raises(ValueError, match="set engine llamacpp"):
        ProfileConfig(gguf_weights="Q8_0")
    with pytest.raises(ValueError, match="quantized_drafters: model cannot draft for the quantized backend"):
        ProfileConfig(drafters=["ngram"], quantized_drafters=["model"])
    assert config.stacked == ["ngram"] and ProfileConfig().stacked == []
