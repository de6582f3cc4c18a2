"""The report's first half: the trade-off on this hardware in numbers — α, ρ and c per drafter,
v(b, k), the seed's equations filled in, the α × k heatmap, speedup against concurrency with its
break-even — and the measured `bench load` cells as they are."""

from __future__ import annotations

import numpy as np

from policies.config import PolicyConfig
from policies.cost_model import (
    best_speculative_k,
    break_even_concurrency,
    expected_tokens,
    speedup,
    step_cost,
    tokens_per_step,
)
from policies.estimates import ProfileCosts
from policies.policy import k_range
from policies.profile import Profile
from profiler.bench_model_fit import ModelFitReport
from profiler.bench_spec import BenchSpecReport

from ..load_report import LoadReport
from . import data as r

HEATMAP_ALPHAS = [round(a, 2) for a in np.linspace(0.05, 0.95, 19)]


CURVE_MAX_BATCH = 64
# Concurrencies the predicted curves are drawn at: every one where break-even usually falls, then sparser.
CURVE_BATCHES = [*range(1, 17), 20, 24, 32, 48, 64]


def machine_of(profile: Profile) -> r.Machine:
    m = profile.model
    cores = profile.machine.get("logical_cores")
    return r.Machine(
        cpu=str(profile.machine.get("cpu", "unknown")),
        cores=int(cores) if isinstance(cores, int | float) else None,
        threads=m.threads,
        device=m.device,
        model=m.name,
        dtype=m.dtype,
        parameters=m.parameters,
        weight_bytes=m.weight_bytes,
    )


def acceptance_rows(profile: Profile) -> list[r.AcceptanceRow]:
    return [
        r.AcceptanceRow(
            category=a.category,
            drafter=a.drafter,
            k=a.k,
            alpha=a.alpha,
            proposal_rate=a.proposal_rate,
            mean_accepted_length=a.mean_accepted_length,
            prompts=a.prompts,
        )
        for a in sorted(profile.acceptance, key=lambda a: (a.category, a.drafter))
    ]


def draft_cost_rows(profile: Profile, costs: ProfileCosts) -> list[r.DraftCostRow]:
    return [
        r.DraftCostRow(
            drafter=d.name,
            kind=d.kind,
            step_ms=d.step_at(1) * 1e3,
            c=costs.draft_cost(d, 1),
            weight_bytes=d.weight_bytes,
        )
        for d in profile.drafters
    ]


def verify_table(profile: Profile, costs: ProfileCosts) -> r.VerifyCosts:
    batches = profile.target.batches
    return r.VerifyCosts(
        batches=batches,
        ks=list(range(profile.target.max_width)),
        v=[costs.verify_costs(b) for b in batches],
        step_ms=[costs.step_s(b) * 1e3 for b in batches],
    )


def equations(profile: Profile, policy: PolicyConfig, costs: ProfileCosts) -> list[r.Equation]:
    k_lo, k_hi = k_range(costs, policy)
    verify = costs.verify_costs(1)
    rows = []
    for a in sorted(profile.acceptance, key=lambda a: (a.category, a.drafter)):
        c = costs.draft_cost(profile.drafter(a.drafter), 1)
        k, gain = best_speculative_k(a.alpha, c, verify, k_lo, k_hi, a.proposal_rate, 1)
        rows.append(
            r.Equation(
                category=a.category,
                drafter=a.drafter,
                alpha=a.alpha,
                proposal_rate=a.proposal_rate,
                k=k,
                c=c,
                v=verify[k],
                expected_tokens=float(expected_tokens(a.alpha, k)),
                tokens_per_step=tokens_per_step(a.alpha, k, a.proposal_rate),
                step_cost=step_cost(k, c, verify[k], a.proposal_rate, 1, verify[0]),
                speedup=gain,
            )
        )
    return rows


def _heatmap_drafter(profile: Profile, policy: PolicyConfig) -> str:
    names = [d.name for d in profile.drafters]
    for kind in policy.speculation.drafters:
        for d in profile.drafters:
            if d.kind == kind:
                return d.name
    return names[0]


def heatmap(profile: Profile, policy: PolicyConfig, costs: ProfileCosts, spec: BenchSpecReport | None) -> r.Heatmap:
    name = _heatmap_drafter(profile, policy)
    drafter = profile.drafter(name)
    c, verify = costs.draft_cost(drafter, 1), costs.verify_costs(1)
    _, k_hi = k_range(costs, policy)
    ks = list(range(1, k_hi + 1))
    grid = [[speedup(a, k, c, verify[k], 1.0, 1, verify[0]) for k in ks] for a in HEATMAP_ALPHAS]
    points = []
    for a in (x for x in profile.acceptance if x.drafter == name):
        # With bench spec results, at the k it ran fixed, so predicted and measured meet at one k.
        fixed = spec.config.fixed_k if spec is not None else [a.k]
        k = min(a.k if a.k in fixed else fixed[0], k_hi)
        points.append(
            r.HeatmapPoint(
                category=a.category,
                alpha=a.alpha,
                proposal_rate=a.proposal_rate,
                k=k,
                predicted=speedup(a.alpha, k, c, verify[k], a.proposal_rate, 1, verify[0]),
                measured=_spec_speedup(spec, a.category, f"{drafter.kind} k={k}"),
            )
        )
    return r.Heatmap(drafter=name, c=c, alphas=HEATMAP_ALPHAS, ks=ks, speedup=grid, points=points)


def _spec_speedup(spec: BenchSpecReport | None, category: str, run: str) -> float | None:
    if spec is None:
        return None
    for result in spec.categories:
        if result.category == category:
            return next((x.speedup for x in result.runs if x.name == run), None)
    return None


def concurrency_curves(
    profile: Profile, policy: PolicyConfig, costs: ProfileCosts, fit: ModelFitReport | None
) -> list[r.ConcurrencyCurve]:
    name = profile.drafter(fit.config.drafter).name if fit is not None else _heatmap_drafter(profile, policy)
    drafter = profile.drafter(name)
    k_lo, k_hi = k_range(costs, policy)
    curves = []
    for category in profile.categories:
        a = profile.acceptance_for(category, name)

        def best(b: int, a=a) -> tuple[int, float]:
            verify = costs.verify_costs(b)
            return best_speculative_k(a.alpha, costs.draft_cost(drafter, b), verify, k_lo, k_hi, a.proposal_rate, b)

        predicted = [r.CurvePoint(batch=b, k=best(b)[0], speedup=best(b)[1]) for b in CURVE_BATCHES]
        measured, be_measured, top = _measured_curve(fit, category)
        curves.append(
            r.ConcurrencyCurve(
                category=category,
                drafter=name,
                predicted=predicted,
                measured=measured,
                break_even_predicted=break_even_concurrency(lambda b: best(b)[1], CURVE_MAX_BATCH),
                break_even_measured=be_measured,
                measured_batches_max=top,
            )
        )
    return curves


def _measured_curve(fit: ModelFitReport | None, category: str) -> tuple[list[r.CurvePoint], int | None, int | None]:
    if fit is None:
        return [], None, None
    mine = [p for p in fit.points if p.category == category]
    points = []
    for b in sorted({p.batch for p in mine}):
        top = max((p for p in mine if p.batch == b), key=lambda p: p.measured)
        points.append(r.CurvePoint(batch=b, k=top.k, speedup=top.measured))
    be = next((x.measured for x in fit.break_even if x.category == category), None)
    return points, be, max(fit.config.batches)


def load_rows(loads: list[LoadReport]) -> tuple[list[r.LoadRow], list[r.LoadComparison]]:
    """Every measured continuous-batching cell, and the router against the fixed backends per level."""
    rows = [
        r.LoadRow(
            level=c.level.label,
            concurrency=c.level.concurrency,
            request_rate=c.level.request_rate,
            mode=c.mode,
            served_by=c.served_by,
            ttft_ms=r.Percentiles(**c.ttft_ms.model_dump()),
            tpot_ms=r.Percentiles(**c.tpot_ms.model_dump()),
            e2e_ms=r.Percentiles(**c.e2e_ms.model_dump()),
            tokens_per_s=c.output_tokens_per_s,
            goodput_rps=c.goodput_rps,
            errors=c.errors,
            requests=c.requests,
        )
        for load in loads
        for c in load.cells
        if c.batching == "continuous"
    ]
    comparisons = [
        r.LoadComparison(
            level=s.level.label,
            best_fixed=s.best_fixed_tokens_mode,
            router_vs=s.router_vs,
            router_goodput_vs=s.router_goodput_vs,
        )
        for load in loads
        for s in load.levels
        if s.batching == "continuous"
    ]
    return rows, comparisons
