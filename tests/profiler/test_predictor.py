import copy
import random
from datetime import UTC, datetime

import pytest

from policies.profile import AcceptanceSample, CostCurve, ModelSummary, Profile, ProfileError
from profiler.predictor import MIN_PROMPTS_TO_BOOST, AlphaPredictor, UnknownDrafterError, cross_validate

NGRAM = "ngram"
MODEL = "model:Tiny-135M@bfloat16"
WORDS = (
    "river mill canal boat lock harbour station market bridge valley quarry engine village school "
    "garden council winter summer festival library museum ferry tower orchard meadow"
).split()
# Synthetic truth: prompts that carry a passage (or code) to copy accept far more with prompt lookup.
TRUE_ALPHA = {
    NGRAM: {"passage": 0.7, "code": 0.6, "question": 0.2},
    MODEL: {"passage": 0.6, "code": 0.55, "question": 0.4},
}
CATEGORY_SHAPE = {
    "summarization": "passage",
    "rag": "passage",
    "translation": "passage",
    "code": "code",
    "chat": "question",
    "qa": "question",
    "math": "question",
}
CHAT_QUESTION = "Why do lighthouses use red lights, and how far can sailors see them?"


def passage(rng: random.Random) -> str:
    sentences = [
        " ".join(rng.choices(WORDS, k=rng.randint(9, 14))).capitalize() + "." for _ in range(rng.randint(4, 7))
    ]
    return " ".join(sentences)


def prompt_text(shape: str, category: str, rng: random.Random) -> str:
    if shape == "passage":
        instruction = {"summarization": "Summarize the text below.", "rag": "Answer using the passages below."}
        return f"{instruction.get(category, 'Translate the following into French.')}\n\n{passage(rng)}"
    if shape == "code":
        name = "_".join(rng.sample(WORDS, 2))
        snippet = f"```python\ndef {name}(x):\n    return x[0] + {name}(x)\n```"
        return f"Fix this function and show the full code.\n\n{snippet}"
    a, b = rng.sample(WORDS, 2)
    return f"Why is the {a} near the {b} so busy? Explain briefly."


def make_samples(seed: int = 0, per_category: int = 7) -> list[AcceptanceSample]:
    rng = random.Random(seed)
    samples = []
    for category, shape in CATEGORY_SHAPE.items():
        for i in range(per_category):
            text = prompt_text(shape, category, rng)
            for drafter, truth in TRUE_ALPHA.items():
                judged = rng.randint(40, 200)
                alpha = min(max(truth[shape] + rng.gauss(0, 0.05), 0.0), 1.0)
                accepted = round(alpha * judged)
                samples.append(
                    AcceptanceSample(
                        prompt_id=f"{category}-{i}",
                        category=category,
                        drafter=drafter,
                        text=text,
                        turns=1,
                        prompt_tokens=max(len(text) // 4, 1),
                        judged_tokens=judged,
                        accepted_tokens=accepted,
                        alpha=accepted / judged,
                    )
                )
    return samples


@pytest.fixture(scope="module")
def samples() -> list[AcceptanceSample]:
    return make_samples()


@pytest.fixture(scope="module")
def fitted(samples) -> AlphaPredictor:
    return AlphaPredictor.fit(samples)


@pytest.fixture
def predictor(fitted) -> AlphaPredictor:
    return copy.deepcopy(fitted)  # each test's online state starts empty; fitting once keeps the module fast


def estimate(predictor: AlphaPredictor, text: str = CHAT_QUESTION, drafter: str = NGRAM, category: str | None = "chat"):
    return predictor.predict(text, turns=1, prompt_tokens=max(len(text) // 4, 1), drafter=drafter, category=category)


def observe(predictor: AlphaPredictor, category: str | None, accepted: int, judged: int, text: str = CHAT_QUESTION):
    predictor.observe(text, 1, max(len(text) // 4, 1), NGRAM, category, accepted_tokens=accepted, judged_tokens=judged)


def make_profile(samples: list[AcceptanceSample]) -> Profile:
    curve = CostCurve(batches=[1, 4], widths=[1, 2], seconds=[[0.01, 0.012], [0.02, 0.024]])
    model = ModelSummary(name="tiny", dtype="float32", device="cpu", parameters=1000, weight_bytes=4000, threads=1)
    return Profile(
        created=datetime(2025, 1, 1, tzinfo=UTC),
        machine={"cpu": "test"},
        model=model,
        libraries={},
        target=curve,
        prefill=curve,
        samples=samples,
    )


def test_cross_validated_error_beats_both_baselines_and_names_the_chosen_model():
    samples = make_samples(per_category=4)  # under MIN_PROMPTS_TO_BOOST prompts: no boosting, a fast test
    scores = cross_validate(samples, folds=5, seed=0)
    assert [s.drafter for s in scores] == sorted(TRUE_ALPHA)
    for score in scores:
        assert score.folds == 5 and score.samples == 28
        assert score.mae_with_category < score.mae_constant
        assert score.mae_text_only < score.mae_constant
        # The truth is a per-shape constant, so the category mean is a strong baseline of its own.
        assert score.mae_category_mean is not None and score.mae_category_mean < score.mae_constant
        assert score.model is not None and "boosting" not in score.model
    assert cross_validate(samples, folds=5, seed=0) == scores  # deterministic
    always = [s.model_copy(update={"requested_steps": 50, "drafts": 50, "proposal_rate": 1.0}) for s in samples]
    proposal = cross_validate(always, folds=5, seed=0, target="proposal_rate")
    assert [(s.target, s.model, s.mae_text_only) for s in proposal] == [("proposal_rate", "constant", 0.0)] * 2


def test_selection_picks_boosting_when_the_truth_is_not_linear():
    # α is high only for mid-length prompts: no weighted sum of features fits that, two splits do.
    rng = random.Random(3)
    samples = []
    for i in range(MIN_PROMPTS_TO_BOOST + 10):
        tokens = rng.choice([20, 40, 150, 200, 250, 900, 1500])
        alpha = 0.8 if 100 <= tokens < 300 else 0.2
        samples.append(
            AcceptanceSample(
                prompt_id=f"p-{i}",
                category="chat",
                drafter=NGRAM,
                text=CHAT_QUESTION,
                turns=1,
                prompt_tokens=tokens,
                judged_tokens=100,
                accepted_tokens=round(100 * alpha),
                alpha=round(100 * alpha) / 100,
            )
        )
    predictor = AlphaPredictor.fit(samples)
    middle = predictor.predict(CHAT_QUESTION, turns=1, prompt_tokens=200, drafter=NGRAM)
    long = predictor.predict(CHAT_QUESTION, turns=1, prompt_tokens=1500, drafter=NGRAM)
    assert "boosting" in middle.source
    assert middle.alpha == pytest.approx(0.8, abs=0.1) and long.alpha == pytest.approx(0.2, abs=0.1)


def test_a_drafter_with_one_alpha_everywhere_predicts_that_constant(samples):
    update = {"judged_tokens": 100, "accepted_tokens": 50, "alpha": 0.5}
    flat = [s.model_copy(update=update) for s in samples if s.drafter == MODEL]
    result = estimate(AlphaPredictor.fit(flat), drafter=MODEL)
    assert result.alpha == pytest.approx(0.5) and "mean of 49 samples" in result.source


def test_cross_validate_skips_drafters_with_too_few_prompts(samples):
    ngram = [s for s in samples if s.drafter == NGRAM]
    few = [s for s in samples if s.drafter == MODEL][:3]
    assert [s.drafter for s in cross_validate([*ngram, *few])] == [NGRAM]
    assert cross_validate(few) == []


def test_predictions_follow_the_text_and_stay_in_range(predictor):
    rng = random.Random(99)
    for drafter in (NGRAM, MODEL):
        for category, shape in CATEGORY_SHAPE.items():
            for given in (category, None):
                result = estimate(predictor, prompt_text(shape, category, rng), drafter, given)
                assert 0.0 <= result.alpha <= 1.0 and 0.0 <= result.model_alpha <= 1.0
                assert result.alpha == pytest.approx(TRUE_ALPHA[drafter][shape], abs=0.15)
    assert predictor.drafters == sorted(TRUE_ALPHA)


def test_fitting_is_deterministic(samples):
    first, second = AlphaPredictor.fit(samples, seed=1), AlphaPredictor.fit(samples, seed=1)
    assert estimate(first) == estimate(second)


def test_unknown_or_missing_category_falls_back_to_text_only(predictor):
    named = estimate(predictor, category="chat")
    unknown = estimate(predictor, category="poetry")
    missing = estimate(predictor, category=None)
    assert "category 'chat'" in named.source
    assert "text only" in unknown.source and "'poetry'" in unknown.source
    assert "text only" in missing.source
    assert unknown.model_alpha == missing.model_alpha


def test_observations_move_the_estimate_toward_what_the_router_saw(predictor):
    before = estimate(predictor)
    assert before.correction == 0.0 and before.observations == 0.0 and "online" not in before.source
    observe(predictor, "chat", accepted=57, judged=60)  # α 0.95, far above the model's ~0.2
    once = estimate(predictor)
    for _ in range(9):
        observe(predictor, "chat", accepted=57, judged=60)
    ten = estimate(predictor)
    assert before.alpha < once.alpha < ten.alpha < 0.95
    assert once.alpha - before.alpha < 0.5 * (0.95 - before.alpha)  # one request only nudges
    assert ten.observations > once.observations > 0
    assert "online correction" in ten.source and "10 requests" in ten.source
    # Only the chat correction and the any-category one moved.
    assert estimate(predictor, category="qa").correction == 0.0
    assert estimate(predictor, category=None).correction > 0.0
    assert estimate(predictor, drafter=MODEL).correction == 0.0


def test_many_observations_dominate_the_model(predictor):
    for _ in range(300):
        observe(predictor, "chat", accepted=57, judged=60)
    assert estimate(predictor).alpha == pytest.approx(0.95, abs=0.05)


def test_decay_lets_recent_observations_win(predictor):
    for _ in range(300):
        observe(predictor, "chat", accepted=57, judged=60)
    for _ in range(300):
        observe(predictor, "chat", accepted=0, judged=60)
    assert estimate(predictor).alpha < 0.1


def test_requests_with_nothing_judged_are_ignored(predictor):
    before = estimate(predictor)
    observe(predictor, "chat", accepted=0, judged=0)
    assert estimate(predictor) == before


def test_impossible_observations_are_rejected(predictor):
    with pytest.raises(ValueError):
        observe(predictor, "chat", accepted=5, judged=4)
    with pytest.raises(ValueError):
        observe(predictor, "chat", accepted=-1, judged=4)


def test_drafters_can_be_named_by_kind(predictor):
    assert estimate(predictor, drafter="model") == estimate(predictor, drafter=MODEL)


def test_ambiguous_kind_and_unknown_drafter_list_the_known_ones(samples):
    other = [s.model_copy(update={"drafter": "model:Other-360M@float32"}) for s in samples if s.drafter == MODEL]
    predictor = AlphaPredictor.fit([*samples, *other])
    with pytest.raises(UnknownDrafterError, match="ambiguous.*Other-360M"):
        estimate(predictor, drafter="model")
    with pytest.raises(UnknownDrafterError, match="no drafter 'early-exit'.*ngram") as error:
        estimate(predictor, drafter="early-exit")
    assert isinstance(error.value, ValueError)


def test_drafters_with_few_samples_predict_their_mean(samples):
    few = [s for s in samples if s.drafter == MODEL][:3]
    predictor = AlphaPredictor.fit(few)
    result = estimate(predictor, drafter="model")
    assert "mean of 3 samples" in result.source and 0.0 <= result.alpha <= 1.0


def test_fit_needs_judged_samples(samples):
    with pytest.raises(ProfileError):
        AlphaPredictor.fit([])
    with pytest.raises(ProfileError):
        AlphaPredictor.fit([s.model_copy(update={"judged_tokens": 0, "accepted_tokens": 0}) for s in samples])


def test_from_profile_refits_from_the_persisted_samples(samples, predictor, tmp_path):
    path = tmp_path / "profile.json"
    make_profile(samples).save(path)
    reloaded = AlphaPredictor.from_profile(Profile.load(path))
    assert reloaded.drafters == predictor.drafters
    assert estimate(reloaded) == estimate(predictor)


def test_from_profile_without_samples_is_refused():
    with pytest.raises(ProfileError, match="no acceptance samples"):
        AlphaPredictor.from_profile(make_profile([]))


def test_invalid_online_settings_are_refused():
    with pytest.raises(ValueError):
        AlphaPredictor({}, decay=0.0)
    with pytest.raises(ValueError):
        AlphaPredictor({}, prior_weight=-1.0)
