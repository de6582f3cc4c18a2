"""The report's conclusion: what to deploy, the measured reasons, and how sure the numbers are."""

from __future__ import annotations

import math

from policies.config import PolicyConfig
from policies.profile import Profile

from ..load_models import ROUTER
from . import data as r


def recommend(report: r.Report, profile: Profile, policy: PolicyConfig) -> r.Recommendation:
    """The cheapest allowed way to meet the SLO (fewest replica-dollars, then lowest e2e p99),
    with the measured reasons behind it and how far the numbers can be trusted."""
    fits = [s for s in report.sizing if s.eligible and s.replicas is not None]
    best = min(fits, key=lambda s: (s.replicas * s.replica_hour_usd, s.e2e_p99_ms), default=None)
    reasons = _reasons(report, profile, policy, best)
    uncertainty = _uncertainty(report, profile)
    if best is None:
        closest = max((s for s in report.sizing if s.eligible), key=lambda s: s.attainment)
        headline = (
            f"No allowed backend meets the SLO within {closest.replicas_tried} replicas on this machine's costs; "
            f"the closest is {closest.backend} ({closest.attainment:.1%} of requests within target)."
        )
        return r.Recommendation(
            backend=closest.backend, replicas=None, headline=headline, reasons=reasons, uncertainty=uncertainty
        )
    bias = mode_bias(report.validation, best.backend)
    padded = math.ceil(best.replicas * (1 + bias) - 1e-9) if bias is not None and bias > 0 else None
    name = "the routed service (auto)" if best.backend == ROUTER else f"the {best.backend} backend alone"
    cost = "n/a" if best.usd_per_million_tokens is None else f"${best.usd_per_million_tokens:.2f}"
    assumed = " at the assumed price" if best.price_assumed else ""
    headline = (
        f"Deploy {name} with {best.replicas} replica{'s' if best.replicas != 1 else ''}: "
        f"{best.attainment:.1%} of requests meet TTFT ≤ {report.workload.slo['ttft_ms']:g} ms and "
        f"TPOT ≤ {report.workload.slo['tpot_ms']:g} ms, e2e p99 {best.e2e_p99_ms:.0f} ms, "
        f"{cost} per 1M output tokens{assumed} (idle time included)."
    )
    if padded is not None and padded > best.replicas:
        headline += (
            f" The simulation ran this backend {bias:.0%} faster than bench load measured: plan {padded} replicas "
            "for that margin."
        )
    return r.Recommendation(
        backend=best.backend,
        replicas=best.replicas,
        bias=bias,
        replicas_with_bias=padded,
        headline=headline,
        reasons=reasons,
        uncertainty=uncertainty,
    )


def mode_bias(validation: r.Validation, mode: str) -> float | None:
    """The mean signed tokens/s error of the closed-loop cells of `mode` (> 0: simulated faster)."""
    errors = [x.tokens_error for x in validation.rows if x.mode == mode and not x.open_loop]
    return sum(errors) / len(errors) if errors else None


def _reasons(report: r.Report, profile: Profile, policy: PolicyConfig, best: r.SizingRow | None) -> list[str]:
    reasons = []
    shares = report.workload.mix
    top: dict[str, r.Equation] = {}  # per category, the drafter with the best predicted speedup at batch 1
    for eq in report.equations:
        if eq.category not in top or eq.speedup > top[eq.category].speedup:
            top[eq.category] = eq
    mine = [eq for eq in top.values() if shares.get(eq.category, 0) > 0]
    if report.workload.prompts_rated:
        reasons.append(
            f"the workload's {report.workload.prompts_rated} prompts were rated one by one by the profile's α/ρ "
            "predictors (no category): the per-category tables above are the profile's, for reference."
        )
    for eq in sorted(mine, key=lambda e: (-shares.get(e.category, 0), e.category))[:3]:
        verdict = "pays" if eq.speedup >= policy.speculation.min_speedup else "does not pay"
        reasons.append(
            f"{eq.category} ({shares.get(eq.category, 0):.0%} of requests): {eq.drafter} drafts with α {eq.alpha:.2f}, "
            f"ρ {eq.proposal_rate:.2f}; at batch 1 its best k = {eq.k} predicts {eq.speedup:.2f}× plain decoding — "
            f"speculation {verdict} (the policy asks {policy.speculation.min_speedup:g}×)."
        )
    stops = [
        f"{c.category} {c.break_even_predicted}"
        + (f" (measured {c.break_even_measured})" if c.break_even_measured is not None else "")
        for c in report.curves
        if shares.get(c.category, 0) > 0 and c.break_even_predicted is not None
    ]
    if stops:
        reasons.append(
            f"speculation stops paying from concurrency (predicted from the profile): {', '.join(stops)}; "
            "past it the router batches on the plain backend instead."
        )
    if profile.quantized is not None and not policy.quantization.meets_floor(profile.quantized.agreement):
        reasons.append(
            f"quantized ({profile.quantized.method}): agrees with the full-precision target on "
            f"{profile.quantized.agreement:.1%} of tokens, under the policy's floor of "
            f"{policy.quantization.min_agreement:.0%}, so it is sized but never recommended."
        )
    if best is not None:
        reasons.append(
            f"at the workload's load each {best.backend} replica is busy {best.utilization:.0%} of the time "
            f"and holds up to {best.memory.planned_batch} requests at once; saturated, one replica serves "
            f"{best.capacity_tokens_per_s:.1f} output tokens/s."
        )
    measured = [
        f"{c.level} {c.router_vs[c.best_fixed]:.2f}× ({c.best_fixed})"
        for c in report.load_comparisons
        if c.best_fixed and c.router_vs.get(c.best_fixed) is not None
    ]
    if measured:
        reasons.append(f"measured, the router's tokens/s over the best fixed backend's: {', '.join(measured)}.")
    return reasons


def _uncertainty(report: r.Report, profile: Profile) -> list[str]:
    v = report.validation
    out = []
    if v.within_tolerance is None:
        out.append("The simulation was not validated on this machine: run `specroute bench load` and pass its JSON.")
    else:
        verdict = "yes" if v.within_tolerance else "NO — read its figures as rough"
        closed = [x for x in v.rows if not x.open_loop]
        if closed and v.mean_abs_tokens_error is not None and v.signed_tokens_error is not None:
            worst = max(closed, key=lambda x: abs(x.tokens_error))
            out.append(
                f"Replaying {len(closed)} measured closed-loop cells, the simulation's tokens/s is off by "
                f"{v.mean_abs_tokens_error:.1%} on average ({v.signed_tokens_error:+.1%} signed: above 0 it is "
                f"optimistic), worst {worst.tokens_error:+.1%} at {worst.level} {worst.mode}."
            )
        if v.mean_abs_e2e_error is not None and v.signed_e2e_error is not None:
            out.append(
                f"Its median end-to-end latency is off by {v.mean_abs_e2e_error:.1%} on average over all "
                f"{len(v.rows)} cells ({v.signed_e2e_error:+.1%} signed: below 0 it is optimistic); "
                f"trusted within {v.tolerance:.0%}: {verdict}."
            )
    counts = [a.prompts for a in profile.acceptance]
    if counts:
        out.append(
            f"α and ρ per category come from {min(counts)}–{max(counts)} prompts each "
            f"({profile.acceptance_source}); your prompts may differ."
        )
    if any(s.price_assumed for s in report.sizing):
        out.append("Prices marked 'assumed' are the workload's $/core-hour assumption, not a quote.")
    if len({s.price_assumed for s in report.sizing}) > 1:
        out.append("Some backends are priced by you and some by the assumption: their costs compare unlike prices.")
    return out
