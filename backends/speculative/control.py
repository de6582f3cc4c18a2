"""What choosing k per step needs measured: the target's step-time curve, each drafter's cost per
draft step, and running acceptance and proposal-rate estimates per request and per drafter, which
the step loop feeds to the cost model's `plan_step`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..pass_timing import PROBE_CONTEXT

Probe = Callable[[int, Sequence[int]], dict[int, float]]  # (batch, widths) -> seconds per width
# (batch, width, context) -> a pass's seconds relative to the profile's reference context
ContextScale = Callable[[int, int, float], float]


def batch_bucket(batch: int) -> int:
    """Batches are measured at powers of two: step time moves slowly between them."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class StepCosts:
    """Seconds of one target forward pass with T new tokens per row at batch b.

    Each batch bucket is probed once for every width (best of a few runs over a short context),
    which gives the curve's *shape*; the passes the engine then runs rescale the bucket's whole
    curve (moving average), which tracks its *level*. Rescaling the curve rather than single
    entries keeps widths that are measured and widths that are not comparable.

    With a `context_scale` (a profile's measured `ContextCurve.factor`), the table holds passes
    over `table_context` cached tokens a row and is read at any context through it: a pass over
    1,000 cached tokens costs more than over 100, and a wide pass relatively less, so k is chosen
    for the context the rows hold now, and a long context's pass does not move the table's level.
    Without one, the level follows whatever contexts the engine runs (with a lag).
    The table depends only on the target, so engines serving one target may share it.
    """

    probe: Probe
    max_width: int
    smoothing: float = 0.2
    target_s: dict[tuple[int, int], float] = field(default_factory=dict)
    context_scale: ContextScale | None = None
    table_context: int = PROBE_CONTEXT
    probe_context: int = PROBE_CONTEXT

    def ensure(self, batch: int) -> None:
        """Probe every bucket a batch of this size can shrink through, so no probe stalls a run."""
        bucket = batch_bucket(batch)
        while bucket >= 1:
            # Widths a seeding profile did not measure (a lookahead block wider than its curve) are probed too.
            missing = [w for w in range(1, self.max_width + 1) if (bucket, w) not in self.target_s]
            if missing:
                measured = self.probe(bucket, missing)
                self.target_s.update(
                    {(bucket, w): s / self._scale(bucket, w, self.probe_context) for w, s in measured.items()}
                )
            bucket //= 2

    def seconds(self, batch: int, width: int, context: float | None = None) -> float:
        """A pass of `width` tokens a row at `batch`, over `context` cached tokens a row (None: the table's)."""
        if not 1 <= width <= self.max_width:
            raise ValueError(f"width {width} is outside the measured 1..{self.max_width}")
        self.ensure(batch)
        return self.target_s[(batch_bucket(batch), width)] * self._scale(batch, width, context)

    def record_target(self, batch: int, width: int, seconds: float, context: float | None = None) -> None:
        """A real forward pass of this width over `context` cached tokens a row took `seconds`:
        move the bucket's curve toward it."""
        bucket = batch_bucket(batch)
        ratio = seconds / self.seconds(batch, width, context)
        factor = 1.0 + self.smoothing * (ratio - 1.0)
        for w in range(1, self.max_width + 1):
            self.target_s[(bucket, w)] *= factor

    def cheapest_width(self, batch: int, needed: int, context: float | None = None) -> int:
        """The cheapest pass width ≥ needed: padding a verify block costs nothing in correctness,
        and some matrix shapes run slower than wider ones."""
        return min(range(needed, self.max_width + 1), key=lambda w: (self.seconds(batch, w, context), w))

    def _scale(self, batch: int, width: int, context: float | None) -> float:
        """A pass over `context` cached tokens a row over one over the table's context."""
        if context is None or self.context_scale is None:
            return 1.0
        return self.context_scale(batch, width, context) / self.context_scale(batch, width, self.table_context)


@dataclass
class DraftCosts:
    """One drafter's seconds per sequential draft step at each batch bucket, and per context token
    it catches up on before drafting (moving averages). Kept per drafter: drafters differ by orders
    of magnitude, so their costs must not mix."""

    smoothing: float = 0.2
    step_s: dict[int, float] = field(default_factory=dict)
    catch_up_token_s: float | None = None
    # Buckets whose step time so far comes only from catch-up calls (an overestimate): the first
    # steady call replaces it rather than being averaged with it.
    provisional: set[int] = field(default_factory=set)

    def record(self, batch: int, steps: int, seconds: float, backlog: int = 0) -> None:
        """A draft call of `steps` sequential steps for `batch` rows took `seconds`, `backlog`
        tokens of it reading context first. A steady call — reading no more than what the last
        verification accepted, at most steps + 1 tokens a row — times the steps; the rest of a
        catch-up call (a row that joined or went without drafts; once a steady time is known)
        times the catching up. Until a bucket has seen a steady call, its step time is the
        catch-up call's, marked provisional."""
        if steps <= 0:
            return
        bucket = batch_bucket(batch)
        steady = backlog <= batch * (steps + 1)
        if steady and bucket in self.provisional:
            self.provisional.discard(bucket)
            self.step_s[bucket] = seconds / steps
        elif steady or bucket not in self.step_s:
            self.step_s[bucket] = self._smoothed(self.step_s.get(bucket), seconds / steps)
            if not steady:
                self.provisional.add(bucket)
        if not steady:
            per_token = max(seconds - steps * self.step_s[bucket], 0.0) / backlog
            self.catch_up_token_s = self._smoothed(self.catch_up_token_s, per_token)

    def catch_up_s(self, backlog: int) -> float:
        return backlog * (self.catch_up_token_s or 0.0)

    def _smoothed(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new


@dataclass
class RateEstimate:
    """Running Beta posterior over a probability (a drafted token's acceptance, a step's chance of
    having a proposal). Old evidence decays so the estimate follows the text (a copied passage,
    then free prose)."""

    prior_mean: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.9
    successes: float = 0.0
    trials: float = 0.0

    @property
    def mean(self) -> float:
        a, b = self._beta()
        return a / (a + b)

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.beta(*self._beta()))

    def add(self, successes: float, trials: float) -> None:
        self.successes = self.decay * self.successes + successes
        self.trials = self.decay * self.trials + trials

    def _beta(self) -> tuple[float, float]:
        prior = min(max(self.prior_mean, 0.01), 0.99) * self.prior_weight
        return prior + self.successes, self.prior_weight - prior + self.trials - self.successes


@dataclass
class DraftOutlook:
    """What one sequence (or one drafter, across sequences) has shown so far: α over the tokens
    judged — a verified block is a run of Bernoulli trials that stops at the first rejection, so
    the evidence is accepted tokens out of accepted + the rejected one — and ρ over the steps that
    asked for drafts."""

    alpha: RateEstimate = field(default_factory=RateEstimate)
    proposal: RateEstimate = field(default_factory=lambda: RateEstimate(prior_mean=0.9))

    def observe(self, asked: int, drafted: int, accepted: int) -> None:
        if not asked:
            return
        self.proposal.add(1.0 if drafted else 0.0, 1.0)
        if drafted:
            self.alpha.add(accepted, accepted + (1 if accepted < asked else 0))

    def observe_declined(self, predicted: float) -> None:
        """A proposal was drafted but not verified at all (its predicted gain did not pay): what it
        was expected to do stands in for the outcome, so drafting that keeps being declined stops
        being planned."""
        self.proposal.add(1.0, 1.0)
        self.alpha.add(predicted, 1.0)

    def seeded(self, weight: float) -> DraftOutlook:
        """A new sequence's outlook, starting from this one's estimates with `weight` samples."""
        return DraftOutlook(
            RateEstimate(prior_mean=self.alpha.mean, prior_weight=weight),
            RateEstimate(prior_mean=self.proposal.mean, prior_weight=weight),
        )
