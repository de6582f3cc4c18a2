"""The α predictor: a prompt's speculative acceptance rate, per drafter, before decoding.

Fitted on the profiler's per-prompt measurements (`AcceptanceSample`) and corrected online from
what the router observes on real requests. Two regressors per drafter: one that also knows the
prompt's category (when the caller names one the profile measured) and one on the text alone.
The same machinery predicts the proposal rate ρ (`target="proposal_rate"`).

Model choice, per drafter, target and regressor, by cross-validation on the training samples
only (folds split prompt ids): the candidates are the weighted mean α ("constant"),
StandardScaler + RidgeCV ("ridge"), and either, for the regressor that knows the category, the
category's mean α plus ridge on the text for the rest ("category mean + ridge") or, for the
text-only one from MIN_PROMPTS_TO_BOOST prompts, shallow gradient boosting ("boosting": trees
on category one-hots would only relearn the category means, at tens of ms a fit where ridge
costs one). The lowest held-out mean
absolute error wins; of equally good ones the simpler (earlier) one. A profile holds ~70 prompts
per drafter and their α is noisy (a prompt often has only a few judged tokens), so ridge usually
wins or ties: a regularised linear model has one weight per feature, changes smoothly with the
prompt, and RidgeCV picks its penalty by exact leave-one-out error at no extra cost; boosting is
kept only where it is measurably better. Everything is deterministic for a given `seed`. Inputs
are clipped to the range seen in training so a prompt far outside it (say 20x longer) cannot
extrapolate without bound, and outputs are clipped to [0, 1].

Drafters are named as the engine names them (`policies.drafters.drafter_name`); lookups accept
the full name or its kind (`policies.drafters.kind_of`) when exactly one fitted drafter has that
kind.

No torch, transformers or ray: the router loads this in its own process.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from sklearn.dummy import DummyRegressor
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.linear_model import RidgeCV
from sklearn.model_selection import KFold
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from policies.drafters import kind_of
from policies.profile import AcceptanceSample, PredictorScore, Profile, ProfileError
from profiler.features import PromptFeatures, prompt_features


@functools.lru_cache(maxsize=16)
def _features(text: str, turns: int, prompt_tokens: int) -> PromptFeatures:
    """A prompt's features, computed once for all its predictions: the router asks α and ρ of
    every drafter for each request (and feeds the outcome back) from the same text."""
    return prompt_features(text, turns, prompt_tokens)


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
# Boosting is a candidate only from this many prompts: depth-2 trees on fewer split on noise.
MIN_PROMPTS_TO_BOOST = 30
# Folds of the inner cross-validation that chooses each regressor.
SELECTION_FOLDS = 5
_RIDGE_ALPHAS = np.logspace(-2, 3, 11)

CONSTANT, RIDGE, CATEGORY_RIDGE, BOOSTING = "constant", "ridge", "category mean + ridge", "boosting"


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


class _Regressor(Protocol):
    def predict(self, x: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class _Fitted:
    """A fitted regressor and the candidate name cross-validation chose it by."""

    name: str
    regressor: _Regressor

    def predict(self, x: np.ndarray) -> float:
        return float(self.regressor.predict(x[None, :])[0])


@dataclass(frozen=True)
class _DrafterModel:
    """One drafter's two fitted regressors and what they were trained on."""

    name: str
    categories: tuple[str, ...]  # the one-hot vocabulary, sorted
    with_category: _Fitted
    text_only: _Fitted
    samples: int
    low: np.ndarray  # per text feature, the training minimum and maximum (inputs are clipped to them)
    high: np.ndarray

    @property
    def chosen(self) -> str:
        """The candidates cross-validation chose, as PredictorScore.model records them."""
        if self.with_category.name == self.text_only.name:
            return self.with_category.name
        return f"{self.with_category.name} (text only: {self.text_only.name})"

    def predict(self, features: np.ndarray, category: str | None) -> tuple[float, str]:
        """(clipped α, which model said so)."""
        x = np.clip(features, self.low, self.high)
        if category is not None and category in self.categories:
            fitted, basis = self.with_category, f"text + category {category!r}"
            x = np.concatenate([x, _one_hot(category, self.categories)])
        else:
            fitted = self.text_only
            basis = "text only, no category given" if category is None else f"text only, category {category!r} unseen"
        alpha = float(np.clip(fitted.predict(x), 0.0, 1.0))
        if fitted.name == CONSTANT:
            return alpha, f"mean of {self.samples} samples"
        return alpha, f"{fitted.name}, {basis}"


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
        """Fit both regressors of every drafter present in `samples`, each chosen by cross-validation.

        Samples with no judged tokens carry no evidence and are left out. Deterministic for a given
        `seed` (it shuffles the selection folds and seeds boosting). Raises ProfileError when no
        sample has judged tokens.
        """
        data = _Data.build(as_target(samples, target))
        if not data.drafters:
            raise ProfileError("no acceptance samples with judged tokens to fit the α predictor on")
        models = {name: _fit_drafter(name, data.rows(name), seed) for name in data.drafters}
        return cls(models, decay=decay, prior_weight=prior_weight)

    @classmethod
    def from_profile(
        cls, profile: Profile, *, decay: float = 0.98, prior_weight: float = 64.0, target: Target = "alpha"
    ) -> AlphaPredictor:
        """Refit from the samples a profile persists (readable JSON, no pickle; with model selection
        fitting takes about a second per target for a ~70-prompt profile)."""
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
        model_alpha, basis = model.predict(_features(text, turns, prompt_tokens).vector(), category)
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
        features = _features(text, turns, prompt_tokens).vector()
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

    Folds split prompt ids, so repeated measurements of one prompt never sit on both sides; each
    training part chooses its own regressors (nested cross-validation), so the held-out prompts
    play no part in the choice. Two baselines: the training folds' mean α weighted like the model's
    samples (sqrt of judged tokens), and the same mean over the prompt's category (the overall one
    for a category the training folds lack). Every MAE is unweighted over held-out prompts; `model`
    names what fitting on all the samples chooses. Drafters with fewer than MIN_SAMPLES_TO_SCORE
    prompts (after dropping samples with no judged tokens) are skipped.
    """
    if folds < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {folds}")
    data = _Data.build(as_target(samples, target))
    scores = []
    for name in data.drafters:
        rows = data.rows(name)
        n_prompts = len(set(rows.prompt_ids))
        if n_prompts < MIN_SAMPLES_TO_SCORE:
            continue
        n_folds = min(folds, n_prompts)
        errors = _fold_errors(name, rows, n_folds, seed)
        scores.append(
            PredictorScore(
                drafter=name,
                target=target,
                folds=n_folds,
                samples=len(rows.alpha),
                mae_with_category=float(np.mean(errors["with_category"])),
                mae_text_only=float(np.mean(errors["text_only"])),
                mae_constant=float(np.mean(errors["constant"])),
                mae_category_mean=float(np.mean(errors["category_mean"])),
                model=_fit_drafter(name, rows, seed).chosen,
            )
        )
    return scores


def _fold_errors(name: str, rows: _Rows, folds: int, seed: int) -> dict[str, list[float]]:
    """Absolute errors on held-out prompts: with category, text only, and the two baselines."""
    errors: dict[str, list[float]] = {"with_category": [], "text_only": [], "constant": [], "category_mean": []}
    for train_mask, test_mask in _prompt_folds(rows.prompt_ids, folds, seed):
        train, test = rows.subset(train_mask), rows.subset(test_mask)
        model = _fit_drafter(name, train, seed)
        mean = float(np.average(train.alpha, weights=train.weight))
        category_means = _category_means(train)
        for x, category, alpha in zip(test.features, test.categories, test.alpha, strict=True):
            errors["with_category"].append(abs(model.predict(x, category)[0] - alpha))
            errors["text_only"].append(abs(model.predict(x, None)[0] - alpha))
            errors["constant"].append(abs(mean - alpha))
            errors["category_mean"].append(abs(category_means.get(category, mean) - alpha))
    return errors


def _prompt_folds(prompt_ids: list[str], folds: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) row masks of shuffled k-fold over the distinct prompt ids."""
    prompts = sorted(set(prompt_ids))
    ids = np.asarray(prompt_ids)
    splits = []
    for _, test_prompts in KFold(folds, shuffle=True, random_state=seed).split(prompts):
        test = np.isin(ids, [prompts[i] for i in test_prompts])
        splits.append((~test, test))
    return splits


def _category_means(rows: _Rows) -> dict[str, float]:
    """Each category's mean α, weighted like the model's samples."""
    categories = np.asarray(rows.categories)
    return {
        c: float(np.average(rows.alpha[categories == c], weights=rows.weight[categories == c]))
        for c in sorted(set(rows.categories))
    }


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


def _fit_drafter(name: str, rows: _Rows, seed: int) -> _DrafterModel:
    categories = tuple(sorted(set(rows.categories)))
    one_hot = np.array([_one_hot(c, categories) for c in rows.categories]).reshape(len(rows.categories), -1)
    with_category = np.hstack([rows.features, one_hot])
    return _DrafterModel(
        name=name,
        categories=categories,
        with_category=_fit_chosen(with_category, rows, seed, categories=len(categories)),
        text_only=_fit_chosen(rows.features, rows, seed, categories=0),
        samples=len(rows.alpha),
        low=rows.features.min(axis=0),
        high=rows.features.max(axis=0),
    )


def _fit_chosen(x: np.ndarray, rows: _Rows, seed: int, categories: int) -> _Fitted:
    """The candidate with the lowest cross-validated MAE on these rows, fitted on all of them.

    `categories`: how many one-hot category columns end `x` (0 for the text-only regressor)."""
    y, weight = rows.alpha, rows.weight
    n_prompts = len(set(rows.prompt_ids))
    if n_prompts < MIN_SAMPLES_TO_REGRESS or np.ptp(y) == 0:
        return _Fitted(CONSTANT, _fit_candidate(CONSTANT, x, y, weight, seed, categories))
    if categories:
        candidates = [CONSTANT, RIDGE, CATEGORY_RIDGE]
    else:
        candidates = [CONSTANT, RIDGE] + ([BOOSTING] if n_prompts >= MIN_PROMPTS_TO_BOOST else [])
    errors = dict.fromkeys(candidates, 0.0)
    for train, test in _prompt_folds(rows.prompt_ids, min(SELECTION_FOLDS, n_prompts), seed):
        for name in candidates:
            regressor = _fit_candidate(name, x[train], y[train], weight[train], seed, categories)
            errors[name] += float(np.sum(np.abs(np.clip(regressor.predict(x[test]), 0.0, 1.0) - y[test])))
    best = min(candidates, key=lambda name: (errors[name], candidates.index(name)))
    return _Fitted(best, _fit_candidate(best, x, y, weight, seed, categories))


def _fit_candidate(
    name: str, x: np.ndarray, y: np.ndarray, weight: np.ndarray, seed: int, categories: int
) -> _Regressor:
    if name == CONSTANT:
        return DummyRegressor(strategy="mean").fit(x, y, sample_weight=weight)
    if name == RIDGE:
        return _ridge().fit(x, y, ridge__sample_weight=weight)
    if name == CATEGORY_RIDGE:
        return _CategoryMeanPlusRidge(categories).fit(x, y, weight)
    # Shallow and slow-learning, with row subsampling: on ~70 noisy points anything deeper memorises.
    boosting = GradientBoostingRegressor(
        n_estimators=50, max_depth=2, learning_rate=0.1, subsample=0.8, min_samples_leaf=3, random_state=seed
    )
    return boosting.fit(x, y, sample_weight=weight)


def _ridge() -> Pipeline:
    # The scaler only puts features on one scale for the penalty, so it is fitted unweighted
    # (weighted variances of constant columns can come out slightly negative and warn).
    # gcv_mode="svd": the same exact leave-one-out choice of penalty, several times faster here.
    return Pipeline([("scale", StandardScaler()), ("ridge", RidgeCV(alphas=_RIDGE_ALPHAS, gcv_mode="svd"))])


class _CategoryMeanPlusRidge:
    """The category's weighted mean α, plus ridge on the text features for what the category
    leaves unexplained. `x` is the text features followed by `categories` one-hot columns; a row
    with no category set (one the training rows lacked) starts from the overall mean."""

    def __init__(self, categories: int) -> None:
        self.categories = categories

    def fit(self, x: np.ndarray, y: np.ndarray, weight: np.ndarray) -> _CategoryMeanPlusRidge:
        text, one_hot = x[:, : -self.categories], x[:, -self.categories :]
        self.overall = float(np.average(y, weights=weight))
        self.means = np.array(
            [np.average(y[col > 0], weights=weight[col > 0]) if col.any() else self.overall for col in one_hot.T]
        )
        self.residual = _ridge().fit(text, y - self._base(one_hot), ridge__sample_weight=weight)
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        text, one_hot = x[:, : -self.categories], x[:, -self.categories :]
        return self._base(one_hot) + self.residual.predict(text)

    def _base(self, one_hot: np.ndarray) -> np.ndarray:
        return np.where(one_hot.any(axis=1), one_hot @ self.means, self.overall)


def _one_hot(category: str, categories: tuple[str, ...]) -> np.ndarray:
    return np.array([1.0 if category == c else 0.0 for c in categories])
