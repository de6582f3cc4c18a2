"""The service's own measurements correcting the profile's predictions.

The profile times each pass alone on an idle machine; in the service the same pass shares the
cores with the proxy, the router, streaming, other requests' prefill and the other backends'
replicas, and each backend pays that differently (the factors measured on a 2-core machine are in
docs/concepts/stages.md). The router therefore keeps, per backend and per load (concurrency in
powers of two), the time per output token each finished request measured over what the profile
predicts for that very request — at the acceptance the request achieved, so a mispredicted α is
the α predictor's to learn, not the cost's — and likewise its time to first token over the
profile's prefill of its uncached prompt. With `calibration.enabled` the policy scales every
candidate by its backend's factors before choosing.

A backend the service has not measured at a load yet takes the factor of the nearest load it was
measured at, else the median of the other backends' (the service's overhead is mostly shared),
and is *explored*: a request is sent there when it is predicted within `explore_within` of the
choice, until `min_observations` requests measured it at that load.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .config import CalibrationConfig
from .estimates import (
    Backend,
    ProfileCosts,
    QuantizedCosts,
    decode_context,
    plain_candidate,
    quantized_candidates,
    speculative_candidate,
)
from .profile import Profile, ProfileError


def load_bucket(concurrency: int) -> int:
    """Loads are told apart at powers of two: the service's overhead per token moves slowly between them."""
    return 1 << max(concurrency - 1, 0).bit_length()


Measure = Literal["tpot", "ttft"]


class Calibration(BaseModel):
    """Each backend's measured-over-predicted time per token and time to first token at one load:
    what `decide` scales by."""

    model_config = ConfigDict(frozen=True)

    bucket: int = Field(ge=1, description="the load (concurrency, a power of two) the factors are for")
    factors: dict[Backend, float] = Field(default_factory=dict, description="measured TPOT over the profile's")
    ttft_factors: dict[Backend, float] = Field(default_factory=dict, description="measured TTFT over the profile's")
    observations: dict[Backend, int] = Field(
        default_factory=dict, description="finished requests behind each factor at this very load"
    )
    sources: dict[Backend, str] = Field(default_factory=dict, description="where each factor comes from, in words")


@dataclass
class ServiceCalibration:
    """The ratios finished requests measured, kept per measure, backend and load (the last `window` of each)."""

    config: CalibrationConfig = field(default_factory=CalibrationConfig)
    ratios: dict[tuple[Measure, str, int], deque[float]] = field(default_factory=dict)

    def observe(
        self, measure: Measure, backend: str, concurrency: int, predicted_ms: float, measured_ms: float
    ) -> None:
        if predicted_ms <= 0 or measured_ms <= 0:
            return
        key = (measure, backend, load_bucket(concurrency))
        self.ratios.setdefault(key, deque(maxlen=self.config.window)).append(measured_ms / predicted_ms)

    def clear(self) -> None:
        """Forget every ratio (a new profile predicts differently)."""
        self.ratios.clear()

    def at(self, concurrency: int, backends: tuple[str, ...]) -> Calibration:
        bucket = load_bucket(concurrency)
        tpot, sources = self._factors("tpot", bucket, backends)
        ttft, _ = self._factors("ttft", bucket, backends)
        observations = {b: len(self.ratios.get(("tpot", b, bucket), ())) for b in backends}
        return Calibration(bucket=bucket, factors=tpot, ttft_factors=ttft, observations=observations, sources=sources)

    def _factors(
        self, measure: Measure, bucket: int, backends: tuple[str, ...]
    ) -> tuple[dict[str, float], dict[str, str]]:
        """Each backend's median at the nearest load it has enough ratios at; a backend with none
        takes the others' median (the service's overhead is mostly shared)."""
        factors, sources = {}, {}
        for backend in backends:
            near = self._nearest(measure, backend, bucket)
            if near is not None:
                ratios = self.ratios[(measure, backend, near)]
                factors[backend] = statistics.median(ratios)
                sources[backend] = f"{len(ratios)} requests" + ("" if near == bucket else f" at concurrency ~{near}")
        shared = statistics.median(factors.values()) if factors else None
        for backend in backends:
            if backend not in factors and shared is not None:
                factors[backend] = shared
                sources[backend] = "not measured here yet: the other backends' median"
        return factors, sources

    def _nearest(self, measure: Measure, backend: str, bucket: int) -> int | None:
        """The load closest to `bucket` (in powers of two) at which `backend` has enough ratios."""
        enough = self.config.min_observations
        measured = [
            b for (m, x, b), ratios in self.ratios.items() if (m, x) == (measure, backend) and len(ratios) >= enough
        ]
        return min(measured, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b), default=None)

    def summary(self) -> dict[str, dict[int, dict[str, float]]]:
        """Per backend and load: the median factor of each measure and how many requests it rests on (/healthz)."""
        out: dict[str, dict[int, dict[str, float]]] = {}
        for (measure, backend, bucket), ratios in sorted(self.ratios.items()):
            row = out.setdefault(backend, {}).setdefault(bucket, {})
            row[measure] = statistics.median(ratios)
            if measure == "tpot":
                row["requests"] = len(ratios)
        return out


def predicted_tpot_ms(
    profile: Profile,
    backend: str,
    drafter: str | None,
    concurrency: int,
    prompt_tokens: int,
    completion_tokens: int,
    k_bounds: tuple[int, int],
    achieved: tuple[float, float] | None = None,
) -> float | None:
    """What the profile predicts per output token for a finished request: its backend (and
    drafter) at the concurrency it was routed at, its prompt and answer lengths, and — for a
    speculating request — the (α, ρ) it achieved. None where the profile cannot say (no quantized
    curve, a drafter it never measured, speculation that judged nothing)."""
    costs = ProfileCosts(profile, decode_context(prompt_tokens, completion_tokens))
    b, tokens = max(concurrency, 1), max(completion_tokens, 1)
    if backend == "plain" or (backend == "speculative" and drafter is None):
        return plain_candidate(costs, b, prompt_tokens, tokens).tpot_ms
    if drafter is not None and achieved is None:
        return None
    try:
        if backend == "speculative":
            assert achieved is not None and drafter is not None
            alpha, rho = achieved
            spec = speculative_candidate(
                costs, profile.drafter(drafter), alpha, "achieved", rho, b, prompt_tokens, tokens, k_bounds
            )
            return spec.tpot_ms
        alphas = {drafter: (achieved[0], "achieved", achieved[1])} if drafter and achieved else {}
        found = [
            c for c in quantized_candidates(costs, b, prompt_tokens, tokens, alphas, k_bounds) if c.drafter == drafter
        ]
    except ProfileError:
        return None
    return found[0].tpot_ms if found else None


def predicted_ttft_ms(
    profile: Profile, backend: str, concurrency: int, prompt_tokens: int, cached_tokens: int = 0
) -> float | None:
    """What the profile predicts for a finished request's time to first token: the prefill of the
    prompt tokens its backend did not hold cached, on that backend's weights (None: no quantized
    curve)."""
    costs = ProfileCosts(profile)
    uncached = max(prompt_tokens - cached_tokens, 1)
    if backend != "quantized":
        return costs.ttft_s(uncached) * 1e3
    if profile.quantized is None:
        return None
    return QuantizedCosts(costs, max(concurrency, 1)).ttft_s(uncached) * 1e3
