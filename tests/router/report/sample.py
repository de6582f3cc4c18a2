"""A complete, plausible `Report` built by hand, so the plots and the page can be tested without
measuring anything. The derived figures (E, speedups, errors, ratios) follow the seed's formulas
from the hand-picked inputs, so the page's equations read true."""

from __future__ import annotations

import math

from router.report.data import (
    AcceptanceRow,
    ConcurrencyCurve,
    CurvePoint,
    DraftCostRow,
    Equation,
    Heatmap,
    HeatmapPoint,
    InputFile,
    LoadComparison,
    LoadRow,
    Machine,
    Memory,
    Percentiles,
    Recommendation,
    Report,
    SizingRow,
    Validation,
    ValidationRow,
    VerifyCosts,
    WhatIfRow,
    WorkloadSummary,
)

NGRAM = "ngram"
MODEL = "model:SmolLM2-135M-Instruct@bfloat16"
CATEGORIES = ("code", "chat", "summarize")
BATCHES = [1, 2, 4, 8, 16, 32]
KS = list(range(9))
CONCURRENCY = [1, 2, 4, 8, 16]
MODES = ("auto", "speculative", "plain", "quantized")
TARGET_STEP_MS = 24.0
KV_BYTES_PER_TOKEN = 12288
# (α, ρ) per category and drafter: prompt lookup proposes only on a match, a draft model always.
ACCEPTANCE = {
    ("code", NGRAM): (0.71, 0.93),
    ("chat", NGRAM): (0.38, 0.55),
    ("summarize", NGRAM): (0.62, 0.88),
    ("code", MODEL): (0.78, 1.0),
    ("chat", MODEL): (0.64, 1.0),
    ("summarize", MODEL): (0.69, 1.0),
}
DRAFT = {NGRAM: ("ngram", 0.37, None), MODEL: ("model", 5.9, 269_060_096)}


def expected_tokens(alpha: float, k: int) -> float:
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _v(batch: int, k: int) -> float:
    """A (k + 1)-token pass grows dearer per token as the batch fills the machine's compute."""
    return round(1 + k * 0.055 * batch**0.8, 4)


def _speedup(alpha: float, rho: float, k: int, c: float, v: float) -> tuple[float, float, float]:
    e = expected_tokens(alpha, k)
    tokens = 1 + rho * (e - 1)
    cost = k * c + rho * v + (1 - rho)
    return e, tokens, cost


def _c(drafter: str) -> float:
    return round(DRAFT[drafter][1] / TARGET_STEP_MS, 4)


def _best(alpha: float, rho: float, c: float, batch: int) -> tuple[int, float]:
    """The best k ≥ 1 and its speedup at a batch (below 1.0 once speculation stops paying)."""
    scored = []
    for k in KS[1:]:
        _, tokens, cost = _speedup(alpha, rho, k, c, _v(batch, k))
        scored.append((tokens / cost, k))
    s, k = max(scored)
    return k, s


def _machine() -> Machine:
    return Machine(
        cpu="AMD EPYC 7B13 64-Core Processor",
        cores=8,
        threads=16,
        device="cpu",
        model="Qwen2.5-0.5B-Instruct",
        dtype="bfloat16",
        parameters=494_032_768,
        weight_bytes=988_065_536,
    )


def _inputs(with_load: bool) -> list[InputFile]:
    load = (
        InputFile(name="bench load", path="bench-load.json", created="2025-06-01T09:12:00+00:00", status="read")
        if with_load
        else InputFile(
            name="bench load",
            path=None,
            status="missing: run `specroute bench load --out bench-load.json` (or pass its JSON), or use --measure",
        )
    )
    return [
        InputFile(
            name="profile", path="/root/.specroute/profile.json", created="2025-05-30T18:40:00+00:00", status="read"
        ),
        InputFile(name="workload", path="workload.yaml", status="read"),
        load,
        InputFile(name="bench spec", path="bench-spec.json", created="2025-05-31T10:02:00+00:00", status="read"),
        InputFile(name="model fit", path="model-fit.json", created="2025-05-31T11:30:00+00:00", status="read"),
        InputFile(
            name="compare profile",
            path=None,
            status="missing: run `specroute profile` on the other machine and pass --compare PROFILE",
        ),
    ]


def _workload() -> WorkloadSummary:
    return WorkloadSummary(
        name="support-mix",
        source="workload.yaml",
        mix={"code": 0.3, "chat": 0.5, "summarize": 0.2},
        prompts_rated=240,
        input_tokens_mean=412.6,
        output_tokens_mean=187.3,
        arrival_rate=0.75,
        concurrency=CONCURRENCY,
        slo={"ttft_ms": 800.0, "tpot_ms": 90.0, "attainment": 0.9},
        simulated_requests=2000,
    )


def _acceptance() -> list[AcceptanceRow]:
    rows = []
    for (category, drafter), (alpha, rho) in ACCEPTANCE.items():
        e = expected_tokens(alpha, 4)
        rows.append(
            AcceptanceRow(
                category=category,
                drafter=drafter,
                k=4,
                alpha=alpha,
                proposal_rate=rho,
                mean_accepted_length=e - 1,
                prompts=80,
            )
        )
    return rows


def _draft_costs() -> list[DraftCostRow]:
    return [
        DraftCostRow(drafter=name, kind=kind, step_ms=ms, c=_c(name), weight_bytes=weights)
        for name, (kind, ms, weights) in DRAFT.items()
    ]


def _verify() -> VerifyCosts:
    return VerifyCosts(
        batches=BATCHES,
        ks=KS,
        v=[[_v(b, k) for k in KS] for b in BATCHES],
        step_ms=[round(TARGET_STEP_MS + 2.6 * b, 2) for b in BATCHES],
    )


def _equations() -> list[Equation]:
    rows = []
    for (category, drafter), (alpha, rho) in ACCEPTANCE.items():
        c = _c(drafter)
        k, speedup = _best(alpha, rho, c, 1)
        e, tokens, cost = _speedup(alpha, rho, k, c, _v(1, k))
        rows.append(
            Equation(
                category=category,
                drafter=drafter,
                alpha=alpha,
                proposal_rate=rho,
                k=k,
                c=c,
                v=_v(1, k),
                expected_tokens=e,
                tokens_per_step=tokens,
                step_cost=cost,
                speedup=speedup,
            )
        )
    return rows


def _heatmap(with_load: bool) -> Heatmap:
    c = _c(NGRAM)
    alphas = [round(0.1 * i, 1) for i in range(10)]
    grid = [[expected_tokens(a, k) / (k * c + _v(1, k)) for k in KS[1:]] for a in alphas]
    measured = {"code": 1.42, "summarize": 1.21} if with_load else {}
    points = []
    for category in CATEGORIES:
        alpha, _ = ACCEPTANCE[(category, NGRAM)]
        k, _ = _best(alpha, 1.0, c, 1)
        predicted = expected_tokens(alpha, k) / (k * c + _v(1, k))
        points.append(
            HeatmapPoint(
                category=category,
                alpha=alpha,
                proposal_rate=1.0,
                k=k,
                predicted=predicted,
                measured=measured.get(category),
            )
        )
    return Heatmap(drafter=NGRAM, c=c, alphas=alphas, ks=KS[1:], speedup=grid, points=points)


def _curves(with_load: bool) -> list[ConcurrencyCurve]:
    curves = []
    for i, category in enumerate(CATEGORIES):
        alpha, rho = ACCEPTANCE[(category, NGRAM)]
        c = _c(NGRAM)
        predicted = [CurvePoint(batch=b, k=k, speedup=s) for b in BATCHES for k, s in [_best(alpha, rho, c, b)]]
        # The measured run stops at 16 and lands a few percent under the prediction.
        measured = (
            [CurvePoint(batch=p.batch, k=p.k, speedup=p.speedup * (0.95 - 0.01 * i)) for p in predicted[:5]]
            if with_load
            else []
        )
        curves.append(
            ConcurrencyCurve(
                category=category,
                drafter=NGRAM,
                predicted=predicted,
                measured=measured,
                break_even_predicted=next((p.batch for p in predicted if p.speedup < 1), None),
                break_even_measured=next((p.batch for p in measured if p.speedup < 1), None),
                measured_batches_max=max((p.batch for p in measured), default=None),
            )
        )
    return curves


def _pct(base: float, spread: float = 1.0) -> Percentiles:
    return Percentiles(p50=round(base, 1), p90=round(base * 1.45 * spread, 1), p99=round(base * 2.1 * spread, 1))


def _load_row(level: str, concurrency: int | None, rate: float | None, mode: str, n: float) -> LoadRow:
    """One cell; `n` stands for the load (clients, or requests/s scaled to clients)."""
    plain = 38.0 * n**0.82
    gain = {"auto": max(1.55 - 0.05 * n, 1.0), "speculative": 1.6 - 0.06 * n, "plain": 1.0, "quantized": 1.32}[mode]
    tokens = round(plain * gain, 1)
    served = (
        {"speculative": round(max(0.9 - 0.05 * n, 0.1), 3), "plain": round(min(0.1 + 0.05 * n, 0.9), 3)}
        if mode == "auto"
        else {mode: 1.0}
    )
    tpot = 26.0 * (1 + 0.08 * n) / gain
    ttft = (95.0 + 31.0 * n) * {"auto": 1.0, "speculative": 1.1, "plain": 0.9, "quantized": 0.78}[mode]
    return LoadRow(
        level=level,
        concurrency=concurrency,
        request_rate=rate,
        mode=mode,
        served_by=served,
        ttft_ms=_pct(ttft),
        tpot_ms=_pct(tpot, 0.8),
        e2e_ms=_pct(ttft + 187.3 * tpot),
        tokens_per_s=tokens,
        goodput_rps=round(tokens / 187.3 * (1.0 if tpot < 60 else 0.6), 3),
        errors=1 if (mode == "quantized" and n == 16) else 0,
        requests=64,
    )


def _load(open_loop: bool) -> list[LoadRow]:
    rows = [_load_row(f"c{n}", n, None, mode, n) for n in CONCURRENCY for mode in MODES]
    if open_loop:
        rows += [_load_row(f"r{rate:g}", None, rate, mode, rate * 4) for rate in (0.5, 1.0, 2.0) for mode in MODES]
    return rows


def _comparisons(load: list[LoadRow]) -> list[LoadComparison]:
    out = []
    for level in dict.fromkeys(r.level for r in load):
        cell = {r.mode: r for r in load if r.level == level}
        router = cell["auto"]
        fixed = [m for m in MODES if m != "auto"]
        best = max(("speculative", "plain"), key=lambda m: cell[m].tokens_per_s)
        out.append(
            LoadComparison(
                level=level,
                best_fixed=best,
                router_vs={m: router.tokens_per_s / cell[m].tokens_per_s for m in fixed},
                router_goodput_vs={
                    m: router.goodput_rps / cell[m].goodput_rps if cell[m].goodput_rps > 0.5 else None for m in fixed
                },
            )
        )
    return out


def _validation(load: list[LoadRow]) -> Validation:
    rows = []
    for i, cell in enumerate(r for r in load if r.concurrency is not None and r.mode != "quantized"):
        error = (-0.07, 0.04, 0.11, -0.02, 0.06)[i % 5]
        e2e = cell.e2e_ms.p50
        sim_e2e = e2e * (1 + error / 2) if e2e is not None else 0.0
        rows.append(
            ValidationRow(
                level=cell.level,
                mode=cell.mode,
                open_loop=False,
                measured_tokens_per_s=cell.tokens_per_s,
                simulated_tokens_per_s=cell.tokens_per_s * (1 + error),
                tokens_error=error,
                measured_e2e_p50_ms=e2e,
                simulated_e2e_p50_ms=sim_e2e,
                e2e_error=error / 2,
                measured_ttft_p50_ms=cell.ttft_ms.p50,
                simulated_ttft_p50_ms=(cell.ttft_ms.p50 or 0.0) * 1.12,
            )
        )
    if not rows:
        return Validation(
            rows=[],
            mean_abs_tokens_error=None,
            signed_tokens_error=None,
            mean_abs_e2e_error=None,
            signed_e2e_error=None,
            tolerance=0.15,
            within_tolerance=None,
        )
    mean = sum(abs(r.tokens_error) for r in rows) / len(rows)
    mean_e2e = sum(abs(r.e2e_error or 0.0) for r in rows) / len(rows)
    return Validation(
        rows=rows,
        mean_abs_tokens_error=mean,
        signed_tokens_error=sum(r.tokens_error for r in rows) / len(rows),
        mean_abs_e2e_error=mean_e2e,
        signed_e2e_error=sum(r.e2e_error or 0.0 for r in rows) / len(rows),
        tolerance=0.15,
        within_tolerance=mean <= 0.15,
    )


def _memory(weights: int, drafter: int | None, batch: int, backends: int = 1) -> Memory:
    kv = KV_BYTES_PER_TOKEN * batch * 600 * backends
    total = None if drafter is None else weights + drafter + kv
    return Memory(weights_bytes=weights, drafter_bytes=drafter, kv_bytes=kv, total_bytes=total, planned_batch=batch)


def _sizing() -> list[SizingRow]:
    quantized_weights = 352_321_536
    # (backend, eligible, replicas, attainment, tok/s, capacity, utilization, memory, $/replica-hour)
    specs = [
        ("auto", True, 3, 0.934, 141.2, 96.4, 0.49, _memory(988_065_536 * 2, 269_060_096, 12, 2), 0.64),
        ("speculative", True, 4, 0.912, 140.8, 71.9, 0.49, _memory(988_065_536, 269_060_096, 10), 0.32),
        ("plain", True, None, 0.611, 139.5, 88.3, 0.82, _memory(988_065_536, 0, 16), 0.32),
        ("quantized", False, 2, 0.957, 140.1, 122.7, 0.57, _memory(quantized_weights, 0, 12), 0.32),
    ]
    rows = []
    for backend, eligible, replicas, attainment, tokens, capacity, busy, memory, price in specs:
        n = replicas or 16
        rows.append(
            SizingRow(
                backend=backend,
                eligible=eligible,
                ineligible_reason=None if eligible else "below quality floor",
                replicas=replicas,
                replicas_tried=16,
                attainment=attainment,
                ttft_p99_ms=420.0 + 1200.0 * (1 - attainment),
                tpot_p99_ms=54.0 + 180.0 * (1 - attainment),
                e2e_p99_ms=9800.0 + 30000.0 * (1 - attainment),
                tokens_per_s=tokens,
                capacity_tokens_per_s=capacity,
                utilization=busy,
                mean_requests=round(busy * 6, 2),
                memory=memory,
                replica_hour_usd=price,
                price_assumed=True,
                assumed_cores=8,
                assumed_core_hour_usd=0.04,
                usd_per_million_tokens=n * price / (tokens * 3600) * 1e6 if replicas else None,
                usd_per_million_tokens_busy=price / (capacity * 3600) * 1e6,
            )
        )
    return rows


def _what_if() -> list[WhatIfRow]:
    rows = []
    grid = [("this machine", b, f) for b in ("auto", "speculative", "plain") for f in (1.0, 2.0)]
    grid.append(("h100-profile.json", "auto", 1.0))
    for profile, backend, factor in grid:
        need = (
            {"auto": 2.2, "speculative": 3.1, "plain": 5.5}[backend]
            * factor
            * (0.5 if profile != "this machine" else 1)
        )
        for n in range(1, 7):
            attainment = round(1 / (1 + math.exp(-2.4 * (n - need))), 4)
            rows.append(
                WhatIfRow(
                    scenario=f"{factor:g}× load, {n} replica{'s' if n > 1 else ''}"
                    + ("" if profile == "this machine" else f", {profile}"),
                    backend=backend,
                    replicas=n,
                    load_factor=factor,
                    profile=profile,
                    attainment=attainment,
                    ttft_p99_ms=round(400.0 + 2500.0 * (1 - attainment), 1),
                    tpot_p99_ms=round(50.0 + 120.0 * (1 - attainment), 1),
                    e2e_p99_ms=round(9500.0 + 40000.0 * (1 - attainment), 1),
                    tokens_per_s=round(140.0 * factor * min(1.0, 0.4 + 0.6 * attainment), 1),
                    meets_slo=attainment >= 0.9,
                )
            )
    return rows


def _recommendation(with_load: bool) -> Recommendation:
    uncertainty = ["acceptance was measured on 80 prompts per category; chat's α is the least certain"]
    if not with_load:
        uncertainty.append("no bench load was given: the simulation is not validated against measured serving")
    return Recommendation(
        backend="auto",
        replicas=3,
        headline="Deploy the router (auto) on 3 replicas: it meets the SLO for 93.4% of requests at $3.78 per 1M "
        "output tokens.",
        reasons=[
            "speculation pays below 8 concurrent requests on code and summarize prompts",
            "plain decoding misses the TPOT SLO at any size tried (16 replicas)",
            "quantized is cheaper but below the policy's quality floor",
        ],
        uncertainty=uncertainty,
    )


def sample_report(with_load: bool = True, open_loop: bool = False) -> Report:
    """A full report; `with_load=False` is one made without `bench load` or model-fit results."""
    load = _load(open_loop) if with_load else []
    return Report(
        created="2025-06-01T12:00:00+00:00",
        title="specroute capacity plan: Qwen2.5-0.5B-Instruct on this machine",
        machine=_machine(),
        inputs=_inputs(with_load),
        workload=_workload(),
        acceptance=_acceptance(),
        draft_costs=_draft_costs(),
        verify=_verify(),
        equations=_equations(),
        heatmap=_heatmap(with_load),
        curves=_curves(with_load),
        load=load,
        load_comparisons=_comparisons(load),
        validation=_validation(load),
        sizing=_sizing(),
        what_if=_what_if(),
        recommendation=_recommendation(with_load),
        notes=[
            "prices are assumed at $0.04 per core-hour: set pricing in the workload file for real ones",
            "memory excludes activations and the runtime's own overhead",
        ],
    )
