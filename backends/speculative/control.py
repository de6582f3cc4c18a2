"""Choosing k from measurements: the target's step-time curve, the drafter's cost per token and a
running acceptance estimate per request, fed to the cost model E(α, k) / (k·c + v(b, k))."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from policies.cost_model import best_k

Probe = Callable[[int, Sequence[int]], dict[int, float]]  # (batch, widths) -> seconds per width


def batch_bucket(batch: int) -> int:
    """Batches are measured at powers of two: step time moves slowly between them."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class StepCosts:
    """Seconds of one target pass with T new tokens per row at batch b, probed once per batch
    bucket and then tracked from the passes the engine actually runs (moving average)."""

    probe: Probe
    max_width: int
    smoothing: float = 0.2
    target_s: dict[tuple[int, int], float] = field(default_factory=dict)
    draft_s_per_token: dict[int, float] = field(default_factory=dict)

    def seconds(self, batch: int, width: int) -> float:
        bucket = batch_bucket(batch)
        if (bucket, width) not in self.target_s:
            widths = range(1, max(self.max_width, width) + 1)
            self.target_s.update({(bucket, w): s for w, s in self.probe(bucket, list(widths)).items()})
        return self.target_s[(bucket, width)]

    def record_target(self, batch: int, width: int, seconds: float) -> None:
        self._blend(self.target_s, (batch_bucket(batch), width), seconds)

    def record_draft(self, batch: int, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._blend(self.draft_s_per_token, batch_bucket(batch), seconds / tokens)

    def verify_costs(self, batch: int) -> list[float]:
        """v(b, k) for k = 0..max_width-1: the cheapest pass of at least k+1 tokens (the engine pads
        a block to that width) over a 1-token pass."""
        step = self.seconds(batch, 1)
        return [self.seconds(batch, self.cheapest_width(batch, k + 1)) / step for k in range(self.max_width)]

    def draft_cost(self, batch: int) -> float | None:
        """c: one drafted token's time over one target step; None until measured."""
        per_token = self.draft_s_per_token.get(batch_bucket(batch))
        return None if per_token is None else per_token / self.seconds(batch, 1)

    def cheapest_width(self, batch: int, needed: int) -> int:
        """The cheapest pass width ≥ needed: padding a verify block costs nothing in correctness,
        and some matrix shapes run slower than wider ones."""
        if needed > self.max_width:
            return needed
        return min(range(needed, self.max_width + 1), key=lambda w: (self.seconds(batch, w), w))

    def _blend(self, table: dict, key: object, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds


@dataclass
class AcceptanceTracker:
    """Running Beta posterior over a per-token acceptance probability α.

    Each verified block is a run of Bernoulli trials that stops at the first rejection, so the
    evidence is accepted tokens out of tokens actually judged (accepted + the rejected one).
    Old evidence decays so the estimate follows the text (a copied passage, then free prose).
    """

    prior_alpha: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.9
    accepted: float = 0.0
    judged: float = 0.0

    @property
    def alpha(self) -> float:
        a, b = self._beta()
        return a / (a + b)

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.beta(*self._beta()))

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        judged = accepted + (1 if accepted < drafted else 0)
        self.accepted = self.decay * self.accepted + accepted
        self.judged = self.decay * self.judged + judged

    def _beta(self) -> tuple[float, float]:
        prior = min(max(self.prior_alpha, 0.01), 0.99) * self.prior_weight
        return prior + self.accepted, self.prior_weight - prior + self.judged - self.accepted


@dataclass
class KChooser:
    """Per request: the k maximising expected tokens per unit time, 0 when no k beats a plain step.

    k is chosen by Thompson sampling: α is drawn from the request's posterior, so an uncertain
    estimate still tries drafting now and then (and notices when the text turns predictable),
    while a confident low estimate almost never pays for a wasted draft.
    """

    k_max: int
    tracker: AcceptanceTracker
    rng: np.random.Generator

    def choose(self, costs: StepCosts, batch: int) -> int:
        c = costs.draft_cost(batch)
        k, _ = best_k(self.tracker.sample(self.rng), 0.0 if c is None else c, costs.verify_costs(batch), self.k_max)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        self.tracker.update(drafted, accepted)
