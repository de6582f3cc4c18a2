"""`decide()`: which backend serves a request, in the card's order — bottleneck → speculation →
batching → quantization — with the reasons as short sentences carrying the numbers used.

Pure Python + numpy: every input is explicit (request features, a load snapshot, the measured
profile, the policy config), so each decision can be replayed and unit-tested without Ray or torch.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .calibration import Calibration
from .config import PolicyConfig
from .estimates import (
    Backend,
    Candidate,
    ProfileCosts,
    decode_context,
    measured_ks,
    plain_candidate,
    quantized_candidates,
    speculation_break_even,
    speculative_candidate,
)
from .profile import Profile, ProfileError

Stage = Literal["speculation", "batching", "quantization", "exploration"]


class AlphaInput(BaseModel):
    """A predicted α for one drafter, and where it came from (shown in the reasons)."""

    model_config = ConfigDict(frozen=True)

    alpha: float = Field(ge=0, le=1)
    source: str
    proposal_rate: float | None = Field(None, ge=0, le=1, description="None: the profile's for the category")


class RequestFeatures(BaseModel):
    model_config = ConfigDict(frozen=True)

    prompt_tokens: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    category: str | None = None
    alphas: dict[str, AlphaInput] = Field(
        default_factory=dict, description="predicted α per drafter kind or name; missing ones fall back to the profile"
    )
    cached_tokens: dict[str, int] = Field(
        default_factory=dict,
        description="prompt tokens each backend is expected to hold in its prefix cache (not prefilled again)",
    )


class LoadSnapshot(BaseModel):
    model_config = ConfigDict(frozen=True)

    in_flight: dict[str, int] = Field(default_factory=dict, description="requests running per backend")
    replicas: dict[str, int] = Field(
        default_factory=dict, description="running replicas per backend (absent: one); they share its in-flight load"
    )
    memory_utilization: float | None = Field(None, ge=0, le=1)

    @property
    def concurrency(self) -> int:
        """Sequences decoding where this request lands once it joins: one replica of each backend
        shares a machine (the profile's curves are one machine's), and a backend's load spreads over
        its replicas, so the batch is each backend's in-flight count per replica, summed."""
        per_replica = sum(n / max(self.replicas.get(b, 1), 1) for b, n in self.in_flight.items())
        return math.floor(per_replica + 1e-9) + 1


class Decision(BaseModel):
    backend: Backend
    drafter: str | None = None
    k: int | None = None
    stage: Stage
    concurrency: int
    bottleneck: Literal["memory", "compute"]
    elasticity: float = Field(description="d log(step time) / d log(batch) at this concurrency")
    reasons: list[str]
    candidates: list[Candidate]
    break_even: dict[str, int | None] = Field(
        default_factory=dict,
        description="per drafter: the concurrency from which speculating on this request stops paying (None: not "
        "up to the larger of batching.max_batch and the current concurrency)",
    )

    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.backend == self.backend and c.drafter == self.drafter)


def decide(
    features: RequestFeatures,
    load: LoadSnapshot,
    profile: Profile,
    config: PolicyConfig,
    break_even: bool = True,
    calibration: Calibration | None = None,
) -> Decision:
    """Where the request goes and why. `break_even`: also the concurrency from which each drafter
    stops paying — an explanation (/v1/advise shows it) that routing and the capacity simulation
    skip, as it costs more than the decision itself. `calibration`: the service's measured time per
    token over the profile's, per backend at this load (None: the profile alone, as planning has it)."""
    costs = ProfileCosts(profile, decode_context(features.prompt_tokens, features.max_tokens))
    b = config.concurrency_override or load.concurrency
    # A provisional profile's decisions use what is measured so far: every decision says so first.
    reasons = [why for why in [profile.provisional_reason()] if why]
    plain = plain_candidate(costs, b, features.prompt_tokens, features.max_tokens)
    bottleneck, eps = _bottleneck(costs, b, config, reasons)
    specs = _speculative_candidates(costs, features, b, config, reasons)
    alphas = _quantized_alphas(features, profile, config)
    quantized_all = quantized_candidates(
        costs, b, features.prompt_tokens, features.max_tokens, alphas, k_range(costs, config)
    )
    quantized = _best_quantized(quantized_all, _speculation_gate(b, bottleneck, config), config)
    candidates = [*specs, plain, *quantized_all]
    _count_cached_prefill(candidates, costs, features, reasons)
    calibrated = calibration if calibration is not None and config.calibration.enabled else None
    if calibrated is not None:
        _calibrate(candidates, calibrated, reasons)
    for c in candidates:
        c.meets_slo = _meets_slo(c, config)

    choice, stage = _speculation_stage(specs, bottleneck, b, config, reasons)
    if choice is None:
        choice, stage = _batching_stage(plain, specs, config, reasons)
    choice, stage = _quantization_stage(choice, stage, quantized, b, load, config, profile, reasons)
    if calibrated is not None:
        eligible = _eligible(specs, plain, quantized, bottleneck, b, load, config, profile)
        choice, stage = _explore(choice, stage, eligible, calibrated, config, reasons)
    reasons.append(_slo_reason(choice, config))
    return Decision(
        backend=choice.backend,
        drafter=choice.drafter,
        # Chosen for speculation's sake, k is the predicted best; as the last resort it adapts per step.
        k=choice.k if stage == "speculation" else None,
        stage=stage,
        concurrency=b,
        bottleneck=bottleneck,
        elasticity=eps,
        reasons=reasons,
        candidates=candidates,
        break_even=_break_even(costs, specs, config, b) if break_even else {},
    )


def _count_cached_prefill(
    candidates: list[Candidate], costs: ProfileCosts, features: RequestFeatures, reasons: list[str]
) -> None:
    """Each candidate's predicted TTFT (and latency) counts only the prompt tokens its backend does
    not hold cached: prefill scales alike on every backend, so the measured prefill curve's ratio."""
    prompt, full = features.prompt_tokens, costs.ttft_s(features.prompt_tokens)
    for backend, cached in sorted(features.cached_tokens.items()):
        share = costs.ttft_s(max(prompt - cached, 1)) / full if full > 0 else 1.0
        for c in candidates:
            if c.backend == backend:
                saved = c.ttft_ms * (1 - share)
                c.ttft_ms, c.latency_ms = c.ttft_ms - saved, c.latency_ms - saved
        reasons.append(
            f"prefix cache: the {backend} backend holds about {cached} of the prompt's {prompt} tokens: "
            f"it prefills {share:.0%} of the prompt's time"
        )


def _calibrate(candidates: list[Candidate], calibration: Calibration, reasons: list[str]) -> None:
    """Every candidate's prefill and decode scaled by its backend's measured factors; speedups stay
    over the plain backend, now as this service runs it."""
    factors, ttft = calibration.factors, calibration.ttft_factors
    if not factors:
        reasons.append(
            f"calibration: no request has finished in this service yet (concurrency ~{calibration.bucket}): "
            "the profile's times as measured"
        )
        return
    plain = factors.get("plain", 1.0)
    for c in candidates:
        f, g = factors.get(c.backend, 1.0), ttft.get(c.backend, 1.0)
        decode = c.latency_ms - c.ttft_ms
        c.tpot_ms, c.tokens_per_s, c.speedup = c.tpot_ms * f, c.tokens_per_s / f, c.speedup * plain / f
        c.ttft_ms *= g
        c.latency_ms = c.ttft_ms + decode * f
    parts = ", ".join(
        f"{b} {f:.2f}× per token, {ttft.get(b, 1.0):.2f}× to the first ({calibration.sources.get(b, '')})"
        for b, f in sorted(factors.items())
    )
    reasons.append(
        f"calibration: measured in this service over the profile's prediction, at concurrency "
        f"~{calibration.bucket}: {parts}; the predictions below are scaled by it"
    )


def _eligible(
    specs: list[Candidate],
    plain: Candidate,
    quantized: Candidate | None,
    bottleneck: str,
    b: int,
    load: LoadSnapshot,
    config: PolicyConfig,
    profile: Profile,
) -> list[Candidate]:
    """The best candidate of each backend the policy allows at this load (what exploring may try)."""
    out = [plain]
    spec = config.speculation
    if specs and spec.enabled and _speculation_gate(b, bottleneck, config) is None:
        out.append(max(specs, key=lambda c: c.speedup))
    q = config.quantization
    if quantized is not None and q.enabled and profile.quantized is not None:
        agreement = profile.quantized.agreement
        if q.meets_floor(agreement) and _quantization_justified(plain, b, load, config, agreement) is not None:
            out.append(quantized)
    return out


def _explore(
    choice: Candidate,
    stage: Stage,
    eligible: list[Candidate],
    calibration: Calibration,
    config: PolicyConfig,
    reasons: list[str],
) -> tuple[Candidate, Stage]:
    """Send the request to a backend this service has not measured enough at this load when it is
    predicted close to the choice: a factor is learned only where requests go. The choice itself is
    measured first (a cold service follows the profile), then its close rivals."""
    within, enough = config.calibration.explore_within, config.calibration.min_observations
    if within is None or calibration.observations.get(choice.backend, 0) < enough:
        return choice, stage
    unmeasured = [
        c
        for c in eligible
        if c.backend != choice.backend
        and calibration.observations.get(c.backend, 0) < enough
        and choice.latency_ms >= within * c.latency_ms
    ]
    if not unmeasured:
        return choice, stage
    best = min(unmeasured, key=lambda c: c.latency_ms)
    seen = calibration.observations.get(best.backend, 0)
    reasons.append(
        f"exploration: the {best.backend} backend has {seen} of {enough} requests measured at concurrency "
        f"~{calibration.bucket} in this service and is predicted at {choice.latency_ms / best.latency_ms:.2f}× "
        f"the {choice.backend} choice's speed end to end (≥ {within:g}): this request measures it"
    )
    return best, "exploration"


def _break_even(costs: ProfileCosts, specs: list[Candidate], config: PolicyConfig, b: int) -> dict[str, int | None]:
    ks, b_max = k_range(costs, config), max(config.batching.max_batch, b)
    return {
        c.drafter: speculation_break_even(costs, costs.profile.drafter(c.drafter), c, ks, b_max)
        for c in specs
        if c.drafter is not None
    }


def _bottleneck(costs: ProfileCosts, b: int, config: PolicyConfig, reasons: list[str]) -> tuple[str, float]:
    eps = costs.elasticity(b)
    limit = config.bottleneck.compute_bound_elasticity
    step_ms, single_ms = costs.step_s(b) * 1e3, costs.step_s(1) * 1e3
    share = (
        f"a decode step takes {step_ms:.0f} ms at concurrency {b} ({single_ms:.0f} ms alone) and grows as b^{eps:.2f}"
    )
    if eps < limit:
        reasons.append(f"bottleneck: {share} < b^{limit:g} → memory/overhead-bound: idle compute can verify drafts")
        return "memory", eps
    reasons.append(f"bottleneck: {share} ≥ b^{limit:g} → compute-bound: every extra token costs its share")
    return "compute", eps


def _speculative_candidates(
    costs: ProfileCosts, features: RequestFeatures, b: int, config: PolicyConfig, reasons: list[str]
) -> list[Candidate]:
    spec = config.speculation
    if not spec.enabled:
        return []
    ks = k_range(costs, config, reasons)
    out = []
    for kind in spec.drafters:
        try:
            drafter = costs.profile.drafter(kind)
        except ProfileError:
            reasons.append(f"speculation: drafter {kind} is not in the profile (run `specroute profile --drafters`)")
            continue
        alpha = _alpha_for(features, kind, drafter.name, costs.profile)
        if alpha is None:
            reasons.append(
                f"speculation: no α estimate for {drafter.name}: no prediction for this prompt and no profiled "
                "category given"
            )
            continue
        rho = alpha.proposal_rate
        if rho is None:
            rho = costs.profile.proposal_rate(drafter.name, features.category if _profiled(features, costs) else None)
        args = (costs, drafter, alpha.alpha, alpha.source, rho, b, features.prompt_tokens, features.max_tokens)
        try:
            out.append(speculative_candidate(*args, k_range=ks))
        except ProfileError as exc:  # a structured drafter's pass the profile did not measure
            reasons.append(f"speculation: {exc}")
    return out


def k_range(costs: ProfileCosts, config: PolicyConfig, reasons: list[str] | None = None) -> tuple[int, int]:
    """The policy's k range within what the profile measured (a (k+1)-token pass needs its time)."""
    spec = config.speculation
    k_min, k_max = measured_ks((spec.k_min, spec.k_max), costs)
    if (k_min, k_max) != (spec.k_min, spec.k_max) and reasons is not None:
        reasons.append(
            f"speculation: k limited to {k_min}..{k_max} (policy {spec.k_min}..{spec.k_max}): the profile measured "
            f"passes of up to {costs.target.max_width} tokens"
        )
    return k_min, k_max


def _profiled(features: RequestFeatures, costs: ProfileCosts) -> bool:
    return features.category is not None and features.category in costs.profile.categories


def _alpha_for(features: RequestFeatures, kind: str, name: str, profile: Profile) -> AlphaInput | None:
    given = features.alphas.get(name) or features.alphas.get(kind)
    if given is not None:
        return given
    if features.category is None:
        return None
    try:
        measured = profile.acceptance_for(features.category, name)
    except ProfileError:
        return None
    return AlphaInput(
        alpha=measured.alpha,
        source=f"profiled mean of category {features.category!r}",
        proposal_rate=measured.proposal_rate,
    )


def _speculation_stage(
    specs: list[Candidate], bottleneck: str, b: int, config: PolicyConfig, reasons: list[str]
) -> tuple[Candidate | None, Stage]:
    spec = config.speculation
    if not spec.enabled:
        reasons.append("speculation: disabled by the policy")
        return None, "speculation"
    if not specs:
        return None, "speculation"
    best = max(specs, key=lambda c: c.speedup)
    cost = best.expected_tokens / best.speedup  # k·c + v, with narrow passes where nothing was proposed
    proposes = f", proposes in {best.proposal_rate:.0%} of steps" if best.proposal_rate < 1 else ""
    numbers = (
        f"{best.drafter} α̂={best.alpha:.2f} ({best.alpha_source}){proposes}, best k={best.k}: "
        f"E={best.expected_tokens:.2f} tokens per step for {cost:.2f} plain steps "
        f"(k·c = {best.k}·{best.c:.3f}, v(b,k) = {best.v:.2f}) → {best.speedup:.2f}× plain"
    )
    gate = _speculation_gate(b, bottleneck, config)
    if gate is not None:
        reasons.append(f"speculation: {numbers}; {gate}")
    elif best.speedup < spec.min_speedup:
        reasons.append(f"speculation: {numbers} < {spec.min_speedup:g}× required → do not speculate")
    else:
        reasons.append(f"speculation: {numbers} ≥ {spec.min_speedup:g}× required → speculate")
        return best, "speculation"
    return None, "speculation"


def _speculation_gate(b: int, bottleneck: str, config: PolicyConfig) -> str | None:
    """Why the policy does not speculate at this load, whatever the speedup (None: it may). One rule
    for both backends that speculate."""
    spec = config.speculation
    if spec.max_concurrency is not None and b >= spec.max_concurrency:
        return f"policy: speculate below concurrency {spec.max_concurrency}"
    if bottleneck == "compute" and config.bottleneck.skip_speculation_when_compute_bound:
        return "skipped: decode is compute-bound at this load (policy)"
    return None


def _batching_stage(
    plain: Candidate, specs: list[Candidate], config: PolicyConfig, reasons: list[str]
) -> tuple[Candidate, Stage]:
    if config.batching.enabled:
        reasons.append(
            f"batching: the large-batch plain backend: {plain.tpot_ms:.0f} ms per token per sequence, "
            f"{plain.tokens_per_s:.0f} tokens/s over all sequences"
        )
        return plain, "batching"
    if not specs:
        reasons.append("batching: disabled by the policy, and no drafter can be estimated → plain decoding")
        return plain, "batching"
    # Batching is off, so speculation is what is left: its engine falls back to plain steps (k = 0)
    # whenever no k pays.
    best = max(specs, key=lambda c: c.speedup)
    reasons.append(f"batching: disabled by the policy → speculative backend with {best.drafter} (k adapts, 0 = plain)")
    return best, "batching"


def _quantized_alphas(
    features: RequestFeatures, profile: Profile, config: PolicyConfig
) -> dict[str, tuple[float, str, float]]:
    """α (with its source) and ρ of each drafter the quantized backend speculates with, for this
    request: measured on the quantized model's own tokens for the request's category; else the
    request's predicted α for the target scaled by the measured ratio of the two models' mean α."""
    quantized, spec = profile.quantized, config.speculation
    if quantized is None or not spec.enabled:
        return {}
    out = {}
    profiled = {d.name: d.kind for d in profile.drafters}  # its draft cost is the drafter's profile
    for name in dict.fromkeys(a.drafter for a in quantized.acceptance):
        kind = profiled.get(name)
        if kind not in spec.drafters:
            continue
        measured = quantized.acceptance_for(features.category, name) if features.category else None
        if measured is not None:
            source = f"measured on {quantized.method} for {features.category!r}"
            out[name] = (measured.alpha, source, measured.proposal_rate)
            continue
        given, ratio = features.alphas.get(name) or features.alphas.get(kind), _alpha_ratio(profile, name)
        if given is not None and ratio is not None:
            rho = given.proposal_rate if given.proposal_rate is not None else profile.proposal_rate(name)
            source = f"{given.source} × {ratio:.2f} ({quantized.method}'s measured α over the target's)"
            out[name] = (min(given.alpha * ratio, 1.0), source, rho)
    return out


def _alpha_ratio(profile: Profile, drafter: str) -> float | None:
    """The quantized model's mean α with `drafter` over the target's, on the same categories."""
    assert profile.quantized is not None
    categories = {a.category for a in profile.quantized.acceptance if a.drafter == drafter}
    rows = [a for a in profile.acceptance if a.drafter == drafter and a.category in categories and a.judged_tokens]
    judged = sum(a.judged_tokens for a in rows)
    target = sum(a.alpha * a.judged_tokens for a in rows) / judged if judged else 0.0
    quantized = profile.quantized.mean_alpha(drafter)
    return quantized / target if quantized is not None and target > 0 else None


def _best_quantized(candidates: list[Candidate], gate: str | None, config: PolicyConfig) -> Candidate | None:
    """The quantized backend's fastest way to serve the request: plain, or speculating where the
    speculation policy allows it at this load (`gate` None) and it beats the quantized backend's
    plain decoding by the policy's margin."""
    plain = next((c for c in candidates if c.drafter is None), None)
    if plain is None:
        return None
    margin = config.speculation.min_speedup * plain.speedup
    allowed = [c for c in candidates if c.drafter is not None and gate is None and c.speedup >= margin]
    return min([plain, *allowed], key=lambda c: c.tpot_ms)


def _quantization_stage(
    choice: Candidate,
    stage: Stage,
    quantized: Candidate | None,
    b: int,
    load: LoadSnapshot,
    config: PolicyConfig,
    profile: Profile,
    reasons: list[str],
) -> tuple[Candidate, Stage]:
    q = config.quantization
    if not q.enabled:
        reasons.append("quantization: disabled by the policy")
        return choice, stage
    if quantized is None or profile.quantized is None:
        later = " yet: not routed there until the full profile measures it" if profile.provisional else ""
        reasons.append(f"quantization: the profile has no quantized backend measured{later}")
        return choice, stage
    method, agreement = profile.quantized.method, profile.quantized.agreement
    if not q.meets_floor(agreement):
        reasons.append(f"quantization: {method} quality {agreement:.1%} token agreement < floor {q.min_agreement:.1%}")
        return choice, stage
    why = _quantization_justified(choice, b, load, config, agreement)
    # End to end for this request's max_tokens: prefill differs between the backends too (cache, kernels).
    gain = choice.latency_ms / quantized.latency_ms
    if why is None:
        reasons.append(f"quantization: not justified at this load ({gain:.2f}× over {choice.backend} on offer)")
        return choice, stage
    if gain < q.min_speedup:
        reasons.append(f"quantization: {why}, but {gain:.2f}× over {choice.backend} < {q.min_speedup:g}× required")
        return choice, stage
    stacked = ""
    if quantized.drafter is not None:  # quantization stacked with speculation: k adapts per step
        stacked = (
            f" speculating with {quantized.drafter} (α̂={quantized.alpha:.2f}, {quantized.alpha_source}; best k="
            f"{quantized.k}: {quantized.expected_tokens:.2f} tokens per step)"
        )
    reasons.append(
        f"quantization: {why}; {method} at {agreement:.1%} agreement{stacked} is {gain:.2f}× faster end to end "
        f"than {choice.backend} → quantized backend"
    )
    return quantized, "quantization"


def _quantization_justified(
    choice: Candidate, b: int, load: LoadSnapshot, config: PolicyConfig, agreement: float
) -> str | None:
    q, slo = config.quantization, config.slo
    if q.min_concurrency is not None and b >= q.min_concurrency:
        return f"concurrency {b} ≥ {q.min_concurrency}"
    if q.memory_pressure is not None and load.memory_utilization is not None:
        if load.memory_utilization >= q.memory_pressure:
            return f"memory {load.memory_utilization:.0%} ≥ {q.memory_pressure:.0%}"
    if q.on_slo_miss and slo.tpot_ms is not None and choice.tpot_ms > slo.tpot_ms:
        return f"{choice.backend} misses the TPOT SLO ({choice.tpot_ms:.0f} > {slo.tpot_ms:g} ms)"
    if q.when_faster:
        return f"quality {agreement:.1%} ≥ floor {q.min_agreement:.1%}"
    return None


def _meets_slo(c: Candidate, config: PolicyConfig) -> bool:
    slo = config.slo
    return (slo.ttft_ms is None or c.ttft_ms <= slo.ttft_ms) and (slo.tpot_ms is None or c.tpot_ms <= slo.tpot_ms)


def _slo_reason(choice: Candidate, config: PolicyConfig) -> str:
    slo = config.slo
    parts = []
    if slo.ttft_ms is not None:
        parts.append(f"TTFT {choice.ttft_ms:.0f} ms {'≤' if choice.ttft_ms <= slo.ttft_ms else '>'} {slo.ttft_ms:g}")
    if slo.tpot_ms is not None:
        parts.append(f"TPOT {choice.tpot_ms:.0f} ms {'≤' if choice.tpot_ms <= slo.tpot_ms else '>'} {slo.tpot_ms:g}")
    if not parts:
        return f"slo: none set; predicted TPOT {choice.tpot_ms:.0f} ms"
    verdict = "met" if _meets_slo(choice, config) else "MISSED"
    return f"slo: predicted {', '.join(parts)} → {verdict}"
