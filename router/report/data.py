"""What a capacity-planning report holds: `report.json`, the one source of every number the page
shows and every plot draws. `build.py` fills it from the measurements; `plots.py` and
`render.py` read nothing else, so the HTML and Markdown are a pure function of this file."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

REPORT_VERSION = 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputFile(_Part):
    """One input of the report and what became of it."""

    name: str = Field(
        description="profile, bench load, bench spec, model fit, workload, compare profile, the other engine's profile"
    )
    path: str | None = Field(description="where it was read from; None when missing")
    created: str | None = Field(None, description="when it was measured or written, as it says")
    status: str = Field(description="'read', 'measured now', or 'missing: <how to get it>'")


class Machine(_Part):
    cpu: str
    cores: int | None
    threads: int
    device: str
    model: str
    dtype: str
    parameters: int
    weight_bytes: int


class AcceptanceRow(_Part):
    category: str
    drafter: str
    k: int = Field(description="k the acceptance was measured at")
    alpha: float
    proposal_rate: float
    mean_accepted_length: float
    prompts: int


class DraftCostRow(_Part):
    drafter: str
    kind: str
    step_ms: float = Field(description="one draft step at batch 1")
    c: float = Field(description="c: one draft step over one target step at batch 1")
    weight_bytes: int | None


class VerifyCosts(_Part):
    """v(b, k): a (k + 1)-token target pass over a 1-token pass at batch b (cheapest-width padding)."""

    batches: list[int]
    ks: list[int]
    v: list[list[float]] = Field(description="v[i][j]: batch batches[i], k ks[j]")
    step_ms: list[float] = Field(description="the 1-token pass at each batch, ms")


class Equation(_Part):
    """The seed's formulas with this machine's numbers, for one category and drafter at batch 1."""

    category: str
    drafter: str
    alpha: float
    proposal_rate: float
    k: int = Field(description="the best k at batch 1")
    c: float
    v: float
    expected_tokens: float = Field(description="E(α, k) = (1 − α^(k+1)) / (1 − α)")
    tokens_per_step: float = Field(description="1 + ρ·(E − 1)")
    step_cost: float = Field(description="k·c + v (with ρ < 1: k·c + q·v + (1 − q))")
    speedup: float


class HeatmapPoint(_Part):
    category: str
    alpha: float
    proposal_rate: float = Field(description="ρ: the category's share of steps with a proposal")
    k: int
    predicted: float = Field(description="predicted speedup at this α, k and the category's own ρ")
    measured: float | None = Field(description="bench spec's measured speedup at this k (None: not given)")


class Heatmap(_Part):
    """Predicted speedup over α × k at batch 1 for one drafter's c, with ρ = 1 (the textbook form)."""

    drafter: str
    c: float
    alphas: list[float]
    ks: list[int]
    speedup: list[list[float]] = Field(description="speedup[i][j]: α alphas[i], k ks[j]")
    points: list[HeatmapPoint]


class CurvePoint(_Part):
    batch: int
    speedup: float
    k: int


class ConcurrencyCurve(_Part):
    """Speculation's best speedup over plain decoding as concurrency grows, for one category."""

    category: str
    drafter: str
    predicted: list[CurvePoint] = Field(description="from the profile's α, c and v(b, k)")
    measured: list[CurvePoint] = Field(description="bench model-fit's best measured k per batch (empty: not given)")
    break_even_predicted: int | None = Field(description="first concurrency where speculation stops paying")
    break_even_measured: int | None = Field(description="first measured batch where no k beat plain (None: none)")
    measured_batches_max: int | None = None


class Percentiles(_Part):
    p50: float | None
    p90: float | None
    p99: float | None


class LoadRow(_Part):
    """One measured `bench load` cell (continuous batching)."""

    level: str
    concurrency: int | None
    request_rate: float | None
    mode: str
    served_by: dict[str, float]
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    tokens_per_s: float
    goodput_rps: float
    errors: int
    requests: int


class LoadComparison(_Part):
    level: str
    best_fixed: str | None
    router_vs: dict[str, float | None] = Field(description="router tok/s over each fixed backend's")
    router_goodput_vs: dict[str, float | None]


class ValidationRow(_Part):
    """The simulation of one measured cell, beside the measurement."""

    level: str
    mode: str
    open_loop: bool = Field(description="arrivals at a fixed rate: tokens/s is set by the load, not the service")
    measured_tokens_per_s: float
    simulated_tokens_per_s: float
    tokens_error: float = Field(description="(simulated − measured) / measured")
    measured_e2e_p50_ms: float | None
    simulated_e2e_p50_ms: float
    e2e_error: float | None
    measured_ttft_p50_ms: float | None
    simulated_ttft_p50_ms: float


class Validation(_Part):
    rows: list[ValidationRow]
    mean_abs_tokens_error: float | None = Field(description="mean |tokens/s error| over closed-loop cells")
    signed_tokens_error: float | None = Field(description="mean tokens/s error, closed loop (> 0: simulation faster)")
    mean_abs_e2e_error: float | None = Field(description="mean |e2e p50 error| over every cell")
    signed_e2e_error: float | None = Field(description="mean e2e p50 error, every cell (< 0: simulation faster)")
    tolerance: float = Field(description="the mean |error| the simulation is trusted within, for both metrics")
    within_tolerance: bool | None = Field(description="None: nothing measured to validate against")


class Memory(_Part):
    weights_bytes: int | None
    drafter_bytes: int | None
    kv_bytes: int | None = Field(description="KV cache at the planned batch × (prompt + answer) tokens")
    total_bytes: int | None
    planned_batch: int


class SizingRow(_Part):
    """What serving the whole workload on one kind of backend (or the router) takes."""

    backend: str = Field(description="speculative, plain, quantized, or auto (routed)")
    eligible: bool = Field(description="False: the policy does not allow it (shown, never recommended)")
    ineligible_reason: str | None = Field(
        None, description="why not: 'below quality floor' or 'disabled by the policy'"
    )
    replicas: int | None = Field(description="fewest replicas meeting the SLO; None: not within the most tried")
    replicas_tried: int
    attainment: float = Field(description="share of requests meeting TTFT and TPOT at that size")
    ttft_p99_ms: float
    tpot_p99_ms: float
    e2e_p99_ms: float
    tokens_per_s: float = Field(description="output tokens/s served at the workload's load, all replicas")
    capacity_tokens_per_s: float = Field(description="output tokens/s one replica sustains when saturated")
    utilization: float = Field(description="share of replica-time with at least one request admitted")
    mean_requests: float = Field(description="requests admitted per replica, averaged over time")
    memory: Memory
    replica_hour_usd: float
    price_assumed: bool = Field(description="True: the price is the labelled $/core-hour assumption")
    assumed_cores: int | None = Field(None, description="cores the assumed price counts (None: a given price)")
    assumed_core_hour_usd: float | None = Field(None, description="$/core-hour the assumed price counts")
    usd_per_million_tokens: float | None = Field(description="at the operating point, idle time included")
    usd_per_million_tokens_busy: float | None = Field(description="if replicas were never idle (saturated)")


class WhatIfRow(_Part):
    scenario: str = Field(description="e.g. '10× load, 4 replicas' or a compared profile")
    backend: str
    replicas: int
    load_factor: float
    profile: str = Field(description="which profile's costs")
    attainment: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    e2e_p99_ms: float
    tokens_per_s: float
    meets_slo: bool


class Recommendation(_Part):
    backend: str = Field(description="what to deploy")
    replicas: int | None
    bias: float | None = Field(
        None, description="how much faster than measured the simulation ran this backend's closed loops (mean)"
    )
    replicas_with_bias: int | None = Field(
        None, description="replicas if the simulation is as optimistic for this workload as it was measured to be"
    )
    headline: str
    reasons: list[str]
    uncertainty: list[str]


class Plot(_Part):
    name: str = Field(description="file name of the PNG beside report.html")
    title: str
    caption: str


class WorkloadSummary(_Part):
    name: str
    source: str
    mix: dict[str, float] = Field(description="category → share (a JSONL workload: 'unclassified' 1.0)")
    prompts_rated: int | None = Field(description="prompts of a JSONL workload, each rated by the α/ρ predictors")
    input_tokens_mean: float
    output_tokens_mean: float
    arrival_rate: float | None = Field(description="requests/s the sizing plans for")
    concurrency: list[int] | None
    slo: dict[str, float | None]
    simulated_requests: int


class Report(_Part):
    version: int = REPORT_VERSION
    created: str
    title: str
    machine: Machine
    inputs: list[InputFile]
    workload: WorkloadSummary
    acceptance: list[AcceptanceRow]
    draft_costs: list[DraftCostRow]
    verify: VerifyCosts
    equations: list[Equation]
    heatmap: Heatmap
    curves: list[ConcurrencyCurve]
    load: list[LoadRow]
    load_comparisons: list[LoadComparison]
    validation: Validation
    sizing: list[SizingRow]
    what_if: list[WhatIfRow]
    recommendation: Recommendation
    notes: list[str] = Field(default_factory=list, description="assumptions and limits the reader must know")
    plots: list[Plot] = Field(default_factory=list)
