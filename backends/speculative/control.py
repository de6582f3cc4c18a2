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
    """Seconds of one target forward pass with T new tokens per row at batch b.

    Each batch bucket is probed once for every width (best of a few runs over a short context),
    which gives the curve's *shape*; the passes the engine then runs rescale the bucket's whole
    curve (moving average), which tracks its *level* as contexts grow. Rescaling the curve rather
    than single entries keeps widths that are measured and widths that are not comparable.
    The table depends only on the target, so engines serving one target may share it.
    """

    probe: Probe
    max_width: int
    smoothing: float = 0.2
    target_s: dict[tuple[int, int], float] = field(default_factory=dict)

    def ensure(self, batch: int) -> None:
        """Probe every bucket a batch of this size can shrink through, so no probe stalls a run."""
        bucket = batch_bucket(batch)
        while bucket >= 1:
            if (bucket, 1) not in self.target_s:
                measured = self.probe(bucket, list(range(1, self.max_width + 1)))
                self.target_s.update({(bucket, w): s for w, s in measured.items()})
            bucket //= 2

    def seconds(self, batch: int, width: int) -> float:
        if not 1 <= width <= self.max_width:
            raise ValueError(f"width {width} is outside the measured 1..{self.max_width}")
        self.ensure(batch)
        return self.target_s[(batch_bucket(batch), width)]

    def record_target(self, batch: int, width: int, seconds: float) -> None:
        """A real forward pass of this width took `seconds`: move the bucket's curve toward it."""
        bucket = batch_bucket(batch)
        ratio = seconds / self.seconds(batch, width)
        factor = 1.0 + self.smoothing * (ratio - 1.0)
        for w in range(1, self.max_width + 1):
            self.target_s[(bucket, w)] *= factor

    def verify_costs(self, batch: int) -> list[float]:
        """v(b, k) for k = 0..max_width-1: the cheapest pass of at least k+1 tokens (the engine pads
        a block to that width) over a 1-token pass."""
        step = self.seconds(batch, 1)
        return [self.seconds(batch, self.cheapest_width(batch, k + 1)) / step for k in range(self.max_width)]

    def cheapest_width(self, batch: int, needed: int) -> int:
        """The cheapest pass width ≥ needed: padding a verify block costs nothing in correctness,
        and some matrix shapes run slower than wider ones."""
        return min(range(needed, self.max_width + 1), key=lambda w: (self.seconds(batch, w), w))


@dataclass
class DraftCosts:
    """One drafter's seconds per sequential draft step at each batch bucket (moving average).
    Kept per engine: drafters differ by orders of magnitude, so their costs must not mix."""

    smoothing: float = 0.2
    step_s: dict[int, float] = field(default_factory=dict)

    def record(self, batch: int, steps: int, seconds: float) -> None:
        if steps <= 0:
            return
        bucket, per_step = batch_bucket(batch), seconds / steps
        old = self.step_s.get(bucket)
        self.step_s[bucket] = per_step if old is None else (1 - self.smoothing) * old + self.smoothing * per_step

    def relative(self, batch: int, target: StepCosts) -> float | None:
        """c: one draft step over one target step at this batch; None until measured."""
        per_step = self.step_s.get(batch_bucket(batch))
        return None if per_step is None else per_step / target.seconds(batch, 1)


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

    def choose(self, c: float | None, verify_costs: list[float]) -> int:
        """k for the next step given the drafter's cost c (None: not measured yet) and v(b, ·)."""
        k, _ = best_k(self.tracker.sample(self.rng), 0.0 if c is None else c, verify_costs, self.k_max)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        self.tracker.update(drafted, accepted)
