"""Per-proposal acceptance prediction: how likely each drafted position is to be accepted, given
every earlier one was, judged from what the drafter reports with its proposal.

Every drafter describes each drafted position with a few numbers (`Drafter.acceptance_features`
names them): prompt lookup its match — how long, how often the n-gram occurred and how often it was
followed by the proposed token, how far back, the position in the draft; a draft model, EAGLE,
Medusa or the adapter its own distribution at that position — the top probability (as a logit)
and the entropy. A logistic map turns them into a probability (`AcceptanceMap`, fitted with
scikit-learn on the judged positions of acceptance runs: the profile's, or the engine's own), and
each request refines it online with an offset of its own on the logit scale.

Exactness does not depend on any of this: the numbers describing position j are computed before
its token is drawn (a distribution's top probability and entropy, not the drawn token's own
probability; prompt lookup is deterministic), so choosing how many positions to verify from them
is a stopping rule over the drafted prefix, under which speculative sampling stays exact.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from policies.profile import AcceptanceMap, ReliabilityBin

NGRAM_FEATURES = ("match", "occurrences", "agreement", "distance", "position")
CONFIDENCE_FEATURES = ("confidence", "entropy", "position")
LOGIT_LIMIT = 9.0  # confidence logits are clipped here: p = 1 − 1e-4 is as sure as a draft gets
OFFSET_LIMIT = 4.0  # a request's own correction, on the logit scale
OFFSET_RATE = 0.3  # how far one judged position moves it
REFIT_FIRST = 64  # judged positions before the engine fits a map of its own
REFIT_EVERY = 256
BUFFER = 8192  # the most recent judged positions the engine keeps to refit on
# A refit needs this many judged positions of each outcome: traffic that was (nearly) all rejected
# — chat, where prompt lookup finds little to copy — cannot tell good proposals from bad, and a map
# fitted on it predicted ~0 for every later proposal, code and summaries too (`bench model-fit`).
MIN_OUTCOMES = 16


def confidence_features(top: np.ndarray, entropy: np.ndarray, position: int) -> np.ndarray:
    """(B, 3) CONFIDENCE_FEATURES of one drafted position from the top probability and the
    entropy (nats) of each row's distribution there: logit of the top probability, entropy,
    position."""
    top = np.clip(np.asarray(top, dtype=float), 1e-6, 1 - 1e-6)
    logit = np.clip(np.log(top) - np.log1p(-top), -LOGIT_LIMIT, LOGIT_LIMIT)
    entropy = np.asarray(entropy, dtype=float)
    return np.stack([logit, entropy, np.full_like(logit, float(position))], axis=-1)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return float(np.log(p / (1 - p)))


def constant_map(drafter: str, features: Sequence[str], rate: float, samples: int = 0) -> AcceptanceMap:
    """A map that predicts `rate` whatever the proposal: before anything was judged."""
    return AcceptanceMap(
        drafter=drafter, features=list(features), coef=[0.0] * len(features), intercept=_logit(rate), samples=samples
    )


def fit_map(
    drafter: str,
    features: Sequence[str],
    x: np.ndarray,
    y: np.ndarray,
    groups: np.ndarray | None = None,
    folds: int = 5,
) -> AcceptanceMap:
    """A logistic map fitted on judged positions (x: (n, f) features, y: 1 accepted / 0 rejected).
    With `groups` (the prompt of each position) it is also scored out of fold, whole prompts held
    out: the Brier score, a constant's Brier score and the reliability curve."""
    y = np.asarray(y, dtype=float)
    rate = (y.sum() + 1.0) / (len(y) + 2.0)
    if len(y) < 8 or y.min() == y.max():  # nothing to tell positions apart by yet
        return constant_map(drafter, features, float(rate), len(y))
    model = _fit(x, y)
    scores: dict[str, object] = {}
    if groups is not None and len(set(groups.tolist())) >= 2:
        scores = _out_of_fold(x, y, np.asarray(groups), folds)
    return AcceptanceMap(
        drafter=drafter,
        features=list(features),
        coef=[float(c) for c in model.coef_[0]],
        intercept=float(model.intercept_[0]),
        samples=len(y),
        prompts=0 if groups is None else len(set(groups.tolist())),
        **scores,
    )


def _fit(x: np.ndarray, y: np.ndarray):  # noqa: ANN202 - a scikit-learn estimator
    from sklearn.linear_model import LogisticRegression  # here: scikit-learn is slow to import

    return LogisticRegression(C=1.0, max_iter=300).fit(x, y)


def _out_of_fold(x: np.ndarray, y: np.ndarray, groups: np.ndarray, folds: int) -> dict[str, object]:
    from sklearn.model_selection import GroupKFold

    predicted, constant = np.empty(len(y)), np.empty(len(y))
    for train, test in GroupKFold(n_splits=min(folds, len(set(groups.tolist())))).split(x, y, groups):
        rate = (y[train].sum() + 1.0) / (len(train) + 2.0)
        constant[test] = rate
        single = y[train].min() == y[train].max()
        predicted[test] = rate if single else _fit(x[train], y[train]).predict_proba(x[test])[:, 1]
    return {
        "brier": float(np.mean((predicted - y) ** 2)),
        "brier_constant": float(np.mean((constant - y) ** 2)),
        "reliability": reliability(predicted, y),
    }


def reliability(predicted: np.ndarray, y: np.ndarray, bins: int = 10) -> list[ReliabilityBin]:
    """Predictions in equal-width bins: per non-empty bin its mean prediction and accepted share."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.minimum((predicted * bins).astype(int), bins - 1)
    out = []
    for b in range(bins):
        mask = index == b
        if mask.any():
            out.append(
                ReliabilityBin(
                    low=float(edges[b]),
                    high=float(edges[b + 1]),
                    count=int(mask.sum()),
                    mean_predicted=float(predicted[mask].mean()),
                    accepted_share=float(y[mask].mean()),
                )
            )
    return out


class AcceptancePredictor:
    """One drafter's map, used by every request of a step loop, and the judged positions it keeps.

    It starts from a fitted map (a profile's) or, without one, from a constant at the drafter's
    prior acceptance; the engine's own judged positions replace it — refitted every few hundred —
    once they outnumber what the starting map was fitted on (a constant counts as none), so the map
    follows the machine's traffic, not only the prompts it was fitted on."""

    def __init__(self, drafter: str, features: Sequence[str], start: AcceptanceMap | None = None, prior: float = 0.5):
        if start is not None and list(start.features) != list(features):
            raise ValueError(f"the acceptance map for {drafter} reads {start.features}, the drafter reports {features}")
        self.drafter, self.features = drafter, tuple(features)
        self.map = start or constant_map(drafter, features, prior)
        self._coef, self._intercept = np.asarray(self.map.coef, dtype=float), self.map.intercept
        self.x: deque[np.ndarray] = deque(maxlen=BUFFER)
        self.y: deque[float] = deque(maxlen=BUFFER)
        self.groups: deque[int] = deque(maxlen=BUFFER)
        self.judged = 0
        self._fitted_at = 0
        self._skipped_at = 0  # judged positions when a refit last found too few of an outcome
        # (prediction as used, outcome) of recent judged positions: the map's live calibration.
        self.scored: deque[tuple[float, float]] = deque(maxlen=BUFFER)

    def predict(self, x: np.ndarray, offset: float = 0.0) -> np.ndarray:
        """Acceptance probability of each row of x (n, f), shifted by a request's `offset`."""
        if not len(x):
            return np.zeros(0)
        return _sigmoid(np.asarray(x, dtype=float) @ self._coef + self._intercept + offset)

    def learn(self, x: np.ndarray, y: Sequence[float], group: int, predicted: Sequence[float] = ()) -> None:
        """Judged positions of one proposal (accepted ones, then the first rejected one), from
        request `group`, with what was predicted for them when they were chosen."""
        for features, label in zip(x, y, strict=True):
            self.x.append(np.asarray(features, dtype=float))
            self.y.append(float(label))
            self.groups.append(group)
        self.scored.extend((float(p), float(label)) for p, label in zip(predicted, y, strict=False))
        self.judged += len(y)
        if self._due():
            self.refit()

    def refit(self) -> None:
        """The map from the judged positions kept, unless they hold fewer than MIN_OUTCOMES of
        either outcome: then the map in use stays until the next refit is due."""
        y = np.asarray(self.y)
        if min(y.sum(), len(y) - y.sum()) < MIN_OUTCOMES:
            self._skipped_at = self.judged
            return
        fitted = fit_map(self.drafter, self.features, np.stack(self.x), y)
        self.map = fitted
        self._coef, self._intercept = np.asarray(fitted.coef, dtype=float), fitted.intercept
        self._fitted_at = self.judged

    def fitted(self, folds: int = 5) -> AcceptanceMap:
        """A map fitted on every judged position kept, scored out of fold by request (the map in use
        when nothing was judged)."""
        if not self.y:
            return self.map
        return fit_map(
            self.drafter, self.features, np.stack(self.x), np.asarray(self.y), np.asarray(self.groups), folds
        )

    def live_score(self) -> tuple[int, float, float, list[ReliabilityBin]] | None:
        """Over the positions judged since the start (or the last BUFFER): how many, the Brier
        score of the predictions the loop acted on, that of a constant at their accepted share,
        and the reliability curve. None before anything was judged."""
        if not self.scored:
            return None
        p, y = (np.asarray(v) for v in zip(*self.scored, strict=True))
        return len(y), float(np.mean((p - y) ** 2)), float(np.var(y)), reliability(p, y)

    def _due(self) -> bool:
        own = len(self.y)
        if own < max(REFIT_FIRST, self.map.samples if self._fitted_at == 0 else 0):
            return False
        last = max(self._fitted_at, self._skipped_at)
        return last == 0 or self.judged - last >= REFIT_EVERY


def refine_offset(offset: float, predicted: np.ndarray, accepted: Sequence[float]) -> float:
    """A request's logit offset after one judged proposal: one gradient step of the logistic loss
    on the offset, so a request the map misjudges is corrected within a few steps."""
    if not len(predicted):
        return offset
    step = OFFSET_RATE * float(np.sum(np.asarray(accepted, dtype=float) - predicted))
    return float(np.clip(offset + step, -OFFSET_LIMIT, OFFSET_LIMIT))
