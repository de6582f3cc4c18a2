"""The α predictor: a prompt's speculative acceptance rate, per drafter, before decoding.

Fitted on the profiler's per-prompt measurements (`AcceptanceSample`) and corrected online from
what the router observes on real requests. Two regressors per drafter: one that also knows the
prompt's category (when the caller names one the profile measured) and one on the text alone.

Model choice: StandardScaler + RidgeCV. A profile holds ~42 prompts per drafter (7 categories x 6).
On so few points a shallow forest or boosting was no more accurate in held-out trials on the
project's prompt set (within ~0.02 MAE either way), but its output jumps between leaf values
that each rest on a handful of prompts, while a regularised linear model has one weight per
feature, changes smoothly with the prompt, is exactly reproducible, and RidgeCV picks its penalty
by exact leave-one-out error at no extra cost. Inputs are clipped to the range seen in training
so a prompt far outside it (say 20x longer) cannot extrapolate without bound, and outputs are
clipped to [0, 1].

Drafters are named as the engine names them (`policies.drafters.drafter_name`); lookups accept
the full name or its kind (`policies.drafters.kind_of`) when exactly one fitted drafter has that
kind.

No torch, transformers or ray: the router loads this in its own process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from sklearn.base import RegressorMixin
from sklearn.dummy import DummyRegressor
from sklearn.linear_model import RidgeCV
from sklearn.model_selection import KFold
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from policies.drafters import kind_of
from policies.profile import AcceptanceSample, PredictorScore, Profile, ProfileError
from profiler.features import prompt_features

Target = Literal["alpha", "proposal_rate"]


def as_target(samples: Sequence[AcceptanceSample], target: Target) -> list[AcceptanceSample]:
    """The same machinery predicts a drafter's proposal rate ρ per prompt: each sample is read with
    ρ in place of α and its asking steps as the evidence (drafts of requested steps instead of
    accepted of judged tokens)."""
    if target == "alpha":
        return list(samples)
    return [
        s.model_copy(update={"alpha": s.proposal_rate, "judged_tokens": s.requested_steps, "accepted_tokens": s.drafts})
        for s in samples
    ]


ANY_CATEGORY = "*"
# Below this many prompts a drafter gets its weighted mean α: a regression would fit noise.
MIN_SAMPLES_TO_REGRESS = 6
# Fewer held-out prompts than this make a cross-validated error meaningless.
MIN_SAMPLES_TO_SCORE = 4
_RIDGE_ALPHAS = np.logspace(-2, 3, 11)


class UnknownDrafterError(ProfileError):
    """The predictor was not fitted for this drafter (a ValueError, like every ProfileError)."""


class AlphaEstimate(BaseModel):
    """A predicted acceptance rate and what it is made of."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alpha: float = Field(ge=0, le=1, description="model_alpha + correction, clipped to [0, 1]")
    model_alpha: float = Field(ge=0, le=1, description="the fitted model's prediction")
    correction: float = Field(description="online correction added to model_alpha")
    observations: float = Field(ge=0, description="decayed judged tokens of online evidence behind the correction")
    source: str = Field(description="human-readable: which model and which correction")


@dataclass(frozen=True)
class _DrafterModel:
    """One drafter's two fitted regressors and what they were trained on."""

    name: str
    categories: tuple[str, ...]  # the one-hot vocabulary, sorted
    with_category: RegressorMixin
    text_only: RegressorMixin
    samples: int
    low: np.ndarray  # per text feature, the training minimum and maximum (inputs are clipped to them)
    high: np.ndarray

    def predict(self, features: np.ndarray, category: str | None) -> tuple[float, str]:
        """(clipped α, which model said so)."""
        x = np.clip(features, self.low, self.high)
        if category is not None and category in self.categories:
            estimator, basis = self.with_category, f"text + category {category!r}"
            x = np.concatenate([x, _one_hot(category, self.categories)])
        else:
            estimator = self.text_only
            basis = "text only, no category given" if category is None else f"text only, category {category!r} unseen"
        alpha = float(np.clip(estimator.predict(x[None, :])[0], 0.0, 1.0))
        if isinstance(estimator, DummyRegressor):
            basis = f"mean of {self.samples} samples"
        return alpha, basis


@dataclass
class _Running:
    """Exponentially decayed sums of one (drafter, category) key's online residuals."""

    residual: float = 0.0  # decayed sum of judged_tokens x (observed α - model α)
    weight: float = 0.0  # decayed sum of judged_tokens
    requests: int = 0  # not decayed: for people reading `source`

    def add(self, residual: float, judged_tokens: int, decay: float) -> None:
        self.residual = decay * self.residual + judged_tokens * residual
        self.weight = decay * self.weight + judged_tokens
        self.requests += 1

    def correction(self, prior_weight: float) -> float:
        # The prior pulls toward 0 (trust the fitted model): a few requests nudge, many dominate.
        return self.residual / (self.weight + prior_weight)


class AlphaPredictor:
    """Predicts α per (prompt, drafter) and learns online from what the router observes.

    Each instance keeps its own online state (no globals); it is not locked, so one thread should
    own an instance or callers serialise `observe`.
    """

    def __init__(self, models: dict[str, _DrafterModel], decay: float = 0.98, prior_weight: float = 64.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be non-negative, got {prior_weight}")
        self._models = dict(models)
        self.decay = decay
        self.prior_weight = prior_weight
        self._online: dict[tuple[str, str], _Running] = {}

    @classmethod
    def fit(
        cls,
        samples: Sequence[AcceptanceSample],
        seed: int = 0,
        *,
        decay: float = 0.98,
        prior_weight: float = 64.0,
        target: Target = "alpha",
    ) -> AlphaPredictor:
        """Fit both regressors of every drafter present in `samples`.

        Samples with no judged tokens carry no evidence and are left out. Deterministic: RidgeCV
        has no randomness; `seed` is accepted so callers need not know that (and for any future
        randomised model). Raises ProfileError when no sample has judged tokens.
        """
        del seed
        data = _Data.build(as_target(samples, target))
        if not data.drafters:
            raise ProfileError("no acceptance samples with judged tokens to fit the α predictor on")
        models = {name: _fit_drafter(name, data.rows(name)) for name in data.drafters}
        return cls(models, decay=decay, prior_weight=prior_weight)

    @classmethod
    def from_profile(
        cls, profile: Profile, *, decay: float = 0.98, prior_weight: float = 64.0, target: Target = "alpha"
    ) -> AlphaPredictor:
        """Refit from the samples a profile persists (readable JSON, no pickle; fitting takes ms)."""
        if not profile.samples:
            raise ProfileError(
                "the profile has no acceptance samples to fit the α predictor on: "
                "measure one with `specroute profile` including acceptance"
            )
        return cls.fit(profile.samples, decay=decay, prior_weight=prior_weight, target=target)

    @property
    def drafters(self) -> list[str]:
        return sorted(self._models)

    def predict(
        self, text: str, turns: int, prompt_tokens: int, drafter: str, category: str | None = None
    ) -> AlphaEstimate:
        """α for this prompt with `drafter` (full name or kind): the model's prediction plus the
        online correction of (drafter, category), or of (drafter, any category) without one."""
        model = self._model(drafter)
        category = category or None
        model_alpha, basis = model.predict(prompt_features(text, turns, prompt_tokens).vector(), category)
        running = self._online.get((model.name, category or ANY_CATEGORY), _Running())
        correction = running.correction(self.prior_weight)
        source = f"model ({basis})"
        if running.weight > 0:
            source += f" + online correction {correction:+.3f} from {running.requests} requests"
        return AlphaEstimate(
            alpha=float(np.clip(model_alpha + correction, 0.0, 1.0)),
            model_alpha=model_alpha,
            correction=correction,
            observations=running.weight,
            source=source,
        )

    def observe(
        self,
        text: str,
        turns: int,
        prompt_tokens: int,
        drafter: str,
        category: str | None,
        accepted_tokens: int,
        judged_tokens: int,
    ) -> None:
        """Record what a finished request achieved. Updates (drafter, category) when a category is
        given and (drafter, any category) always, each against the model `predict` would use for
        that key, so each correction corrects exactly the prediction it is added to."""
        if not 0 <= accepted_tokens <= judged_tokens:
            raise ValueError(f"need 0 <= accepted_tokens <= judged_tokens, got {accepted_tokens}/{judged_tokens}")
        model = self._model(drafter)
        if judged_tokens == 0:
            return  # nothing was judged: no evidence about acceptance
        observed = accepted_tokens / judged_tokens
        features = prompt_features(text, turns, prompt_tokens).vector()
        keys = [(None, ANY_CATEGORY)] + ([(category, category)] if category else [])
        for model_category, key in keys:
            model_alpha, _ = model.predict(features, model_category)
            running = self._online.setdefault((model.name, key), _Running())
            running.add(observed - model_alpha, judged_tokens, self.decay)

    def _model(self, drafter: str) -> _DrafterModel:
        if drafter in self._models:
            return self._models[drafter]
        matches = [name for name in self._models if kind_of(name) == drafter]
        if len(matches) == 1:
            return self._models[matches[0]]
        if matches:
            raise UnknownDrafterError(f"drafter kind {drafter!r} is ambiguous: name one of {sorted(matches)}")
        raise UnknownDrafterError(f"the α predictor has no drafter {drafter!r} (fitted: {self.drafters})")


def cross_validate(
    samples: Sequence[AcceptanceSample], folds: int = 5, seed: int = 0, target: Target = "alpha"
) -> list[PredictorScore]:
    """Held-out error of the predictor, per drafter, by shuffled k-fold over prompts.

    Folds split prompt ids, so repeated measurements of one prompt never sit on both sides. The
    constant baseline predicts the training folds' mean α weighted like the model's samples
    (sqrt of judged tokens); every MAE is unweighted over held-out prompts. Drafters with fewer
    than MIN_SAMPLES_TO_SCORE prompts (after dropping samples with no judged tokens) are skipped.
    """
    if folds < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {folds}")
    data = _Data.build(as_target(samples, target))
    scores = []
    for name in data.drafters:
        rows = data.rows(name)
        prompts = sorted(set(rows.prompt_ids))
        if len(prompts) < MIN_SAMPLES_TO_SCORE:
            continue
        n_folds = min(folds, len(prompts))
        errors = _fold_errors(name, rows, prompts, KFold(n_folds, shuffle=True, random_state=seed))
        scores.append(
            PredictorScore(
                drafter=name,
                target=target,
                folds=n_folds,
                samples=len(rows.alpha),
                mae_with_category=float(np.mean(errors[0])),
                mae_text_only=float(np.mean(errors[1])),
                mae_constant=float(np.mean(errors[2])),
            )
        )
    return scores


def _fold_errors(
    name: str, rows: _Rows, prompts: list[str], kfold: KFold
) -> tuple[list[float], list[float], list[float]]:
    """Absolute errors on held-out prompts: with category, text only, constant."""
    with_category: list[float] = []
    text_only: list[float] = []
    constant: list[float] = []
    ids = np.asarray(rows.prompt_ids)
    for _, test_prompts in kfold.split(prompts):
        held_out = np.isin(ids, [prompts[i] for i in test_prompts])
        train, test = rows.subset(~held_out), rows.subset(held_out)
        model = _fit_drafter(name, train)
        mean = float(np.average(train.alpha, weights=train.weight))
        for x, category, alpha in zip(test.features, test.categories, test.alpha, strict=True):
            with_category.append(abs(model.predict(x, category)[0] - alpha))
            text_only.append(abs(model.predict(x, None)[0] - alpha))
            constant.append(abs(mean - alpha))
    return with_category, text_only, constant


@dataclass(frozen=True)
class _Rows:
    """One drafter's training rows as arrays."""

    prompt_ids: list[str]
    categories: list[str]
    features: np.ndarray  # (n, len(FEATURE_NAMES))
    alpha: np.ndarray
    weight: np.ndarray

    def subset(self, mask: np.ndarray) -> _Rows:
        picked = np.flatnonzero(mask)
        return _Rows(
            prompt_ids=[self.prompt_ids[i] for i in picked],
            categories=[self.categories[i] for i in picked],
            features=self.features[picked],
            alpha=self.alpha[picked],
            weight=self.weight[picked],
        )


@dataclass(frozen=True)
class _Data:
    """Usable samples (judged tokens > 0) with their features computed once."""

    samples: list[AcceptanceSample]
    features: np.ndarray

    @classmethod
    def build(cls, samples: Sequence[AcceptanceSample]) -> _Data:
        usable = [s for s in samples if s.judged_tokens > 0]
        vectors = [prompt_features(s.text, s.turns, s.prompt_tokens).vector() for s in usable]
        return cls(usable, np.array(vectors, dtype=np.float64))

    @property
    def drafters(self) -> list[str]:
        return sorted({s.drafter for s in self.samples})

    def rows(self, drafter: str) -> _Rows:
        picked = [i for i, s in enumerate(self.samples) if s.drafter == drafter]
        chosen = [self.samples[i] for i in picked]
        return _Rows(
            prompt_ids=[s.prompt_id for s in chosen],
            categories=[s.category for s in chosen],
            features=self.features[picked],
            alpha=np.array([s.alpha for s in chosen], dtype=np.float64),
            # sqrt: a prompt judged on 4x the tokens has a half-as-noisy α but should not drown the
            # other prompts' variety (it is still one prompt).
            weight=np.sqrt([float(s.judged_tokens) for s in chosen]),
        )


def _fit_drafter(name: str, rows: _Rows) -> _DrafterModel:
    categories = tuple(sorted(set(rows.categories)))
    one_hot = np.array([_one_hot(c, categories) for c in rows.categories]).reshape(len(rows.categories), -1)
    return _DrafterModel(
        name=name,
        categories=categories,
        with_category=_fit_regressor(np.hstack([rows.features, one_hot]), rows.alpha, rows.weight),
        text_only=_fit_regressor(rows.features, rows.alpha, rows.weight),
        samples=len(rows.alpha),
        low=rows.features.min(axis=0),
        high=rows.features.max(axis=0),
    )


def _fit_regressor(x: np.ndarray, y: np.ndarray, weight: np.ndarray) -> RegressorMixin:
    if len(y) < MIN_SAMPLES_TO_REGRESS:
        return DummyRegressor(strategy="mean").fit(x, y, sample_weight=weight)
    # The scaler only puts features on one scale for the penalty, so it is fitted unweighted
    # (weighted variances of constant columns can come out slightly negative and warn).
    pipeline = Pipeline([("scale", StandardScaler()), ("ridge", RidgeCV(alphas=_RIDGE_ALPHAS))])
    return pipeline.fit(x, y, ridge__sample_weight=weight)


def _one_hot(category: str, categories: tuple[str, ...]) -> np.ndarray:
    return np.array([1.0 if category == c else 0.0 for c in categories])
