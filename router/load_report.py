"""What `specroute bench load` reports: per cell (level × mode × batching) TTFT, TPOT and e2e
percentiles, output tokens/s, goodput under the SLO and errors; per level the router's ratio to
every fixed backend and to the best one that meets the policy's quality floor; per backend the
step loop against the static baseline; and the join probe."""

from __future__ import annotations

from collections import Counter

import numpy as np
from pydantic import BaseModel, Field

from .load_models import ROUTER, Batching, Cell, JoinProbe, Level, LoadConfig, Mode, RequestRecord

# The router counts as worse than a fixed backend only below this ratio: a router that picks the
# same backend lands within a couple of percent of it either way, from run-to-run noise alone.
WORSE_BELOW = 0.98


class Percentiles(BaseModel):
    p50: float | None
    p90: float | None
    p99: float | None


class CellStats(BaseModel):
    mode: Mode
    batching: Batching = "continuous"
    level: Level
    requests: int
    errors: int
    error_rate: float
    wall_s: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    output_tokens_per_s: float = Field(description="completion tokens of successful requests / cell wall time")
    slo_met: int
    goodput_rps: float = Field(description="requests meeting both SLOs per wall second")
    served_by: dict[str, float] = Field(description="share of successful requests per backend")
    cached_share: float | None = Field(
        None, description="prompt tokens found in the backends' prefix caches over all prompt tokens (None: unknown)"
    )
    outside_ms: float | None = Field(
        None,
        description="median of the client's TTFT less the TTFT the serving backend reported: what HTTP, the router "
        "and the hop to the backend add (None: no backend reported one)",
    )


class LevelSummary(BaseModel):
    level: Level
    batching: Batching = "continuous"
    best_tokens_mode: Mode
    best_goodput_mode: Mode
    best_fixed_tokens_mode: Mode | None = Field(description="None unless auto and a forced backend both ran")
    best_fixed_goodput_mode: Mode | None
    router_tokens_ratio: float | None = Field(description="router tok/s over the best eligible fixed backend's")
    router_goodput_ratio: float | None = Field(description="None when no eligible fixed backend met the SLO")
    router_vs: dict[str, float | None] = Field(
        default_factory=dict, description="router tok/s over each fixed backend's"
    )
    router_goodput_vs: dict[str, float | None] = Field(default_factory=dict)
    router_worse: bool


class BatchingComparison(BaseModel):
    """One backend at one level: the step loop over the static baseline, in the same run."""

    level: Level
    mode: Mode
    tokens_ratio: float | None = Field(description="continuous tok/s over static")
    ttft_p50_ratio: float | None = Field(description="continuous TTFT p50 over static (below 1: sooner)")


class LoadReport(BaseModel):
    config: LoadConfig
    model: str
    started: str = Field(description="UTC, ISO 8601")
    below_quality_floor: list[str] = Field(
        default_factory=list, description="backends the service's policy may not pick for quality"
    )
    cells: list[CellStats]
    levels: list[LevelSummary]
    batching: list[BatchingComparison] = Field(default_factory=list)
    join: list[JoinProbe] = Field(default_factory=list)
    records: list[RequestRecord]

    def cell(self, mode: Mode, level: Level, batching: Batching = "continuous") -> CellStats:
        return next(c for c in self.cells if (c.mode, c.level, c.batching) == (mode, level, batching))


def build_report(
    config: LoadConfig,
    model: str,
    started: str,
    records: list[RequestRecord],
    walls: dict[Cell, float],
    join: list[JoinProbe],
    below_floor: list[str],
) -> LoadReport:
    cells = [
        cell_stats(config, c, [r for r in records if (r.mode, r.level, r.batching) == (c.mode, c.level, c.batching)], s)
        for c, s in walls.items()
    ]
    order = {level: i for i, level in enumerate(config.levels())}
    cells.sort(key=lambda c: (order[c.level], config.batching.index(c.batching), config.modes.index(c.mode)))
    levels = [
        level_summary([c for c in cells if (c.level, c.batching) == (level, batching)], below_floor)
        for level in config.levels()
        for batching in config.batching
    ]
    return LoadReport(
        config=config,
        model=model,
        started=started,
        below_quality_floor=below_floor,
        cells=cells,
        levels=levels,
        batching=_batching_comparisons(cells),
        join=join,
        records=records,
    )


def percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(p50=None, p90=None, p99=None)
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return Percentiles(p50=p50, p90=p90, p99=p99)


def _meets_slo(config: LoadConfig, record: RequestRecord) -> bool:
    if record.error is not None:
        return False
    # A stream that never produced content made its client wait its whole length for nothing.
    ttft = record.ttft_ms if record.ttft_ms is not None else record.e2e_ms
    return ttft <= config.slo_ttft_ms and (record.tpot_ms is None or record.tpot_ms <= config.slo_tpot_ms)


def cell_stats(config: LoadConfig, cell: Cell, records: list[RequestRecord], wall_s: float) -> CellStats:
    ok = [r for r in records if r.error is None]
    met = sum(_meets_slo(config, r) for r in records)
    backends = Counter(r.backend or "unknown" for r in ok)
    return CellStats(
        mode=cell.mode,
        batching=cell.batching,
        level=cell.level,
        requests=len(records),
        errors=len(records) - len(ok),
        error_rate=(len(records) - len(ok)) / len(records),
        wall_s=wall_s,
        ttft_ms=percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        tpot_ms=percentiles([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        e2e_ms=percentiles([r.e2e_ms for r in ok]),
        output_tokens_per_s=sum(r.completion_tokens for r in ok) / wall_s,
        slo_met=met,
        goodput_rps=met / wall_s,
        served_by={name: n / len(ok) for name, n in backends.most_common()},
        cached_share=_cached_share(ok),
        outside_ms=_outside_backend(ok),
    )


def _outside_backend(records: list[RequestRecord]) -> float | None:
    """The median TTFT a request spent outside the backend that served it (its `specroute.ttft_ms`
    counts from the backend's receipt of the request; a retried one's counts from its last attempt)."""
    gaps = [
        r.ttft_ms - r.route["ttft_ms"]
        for r in records
        if r.ttft_ms is not None and r.route and r.route.get("ttft_ms") is not None and not r.route.get("retried")
    ]
    return float(np.median(gaps)) if gaps else None


def _cached_share(records: list[RequestRecord]) -> float | None:
    counted = [r for r in records if r.prompt_tokens and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in counted)
    return sum(r.cached_tokens or 0 for r in counted) / prompt if prompt else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def level_summary(cells: list[CellStats], below_floor: list[str] = ()) -> LevelSummary:
    """The cells of one level and batching compared; the router is judged against the fixed
    backends that meet the quality floor (a backend the policy may not pick is no fair rival)."""
    best_tokens = max(cells, key=lambda c: c.output_tokens_per_s)
    best_goodput = max(cells, key=lambda c: c.goodput_rps)
    router = next((c for c in cells if c.mode == ROUTER), None)
    fixed = [c for c in cells if c.mode != ROUTER]
    eligible = [c for c in fixed if c.mode not in below_floor] or fixed
    base = {"level": cells[0].level, "batching": cells[0].batching}
    if router is None or not fixed:
        return LevelSummary(
            **base,
            best_tokens_mode=best_tokens.mode,
            best_goodput_mode=best_goodput.mode,
            best_fixed_tokens_mode=None,
            best_fixed_goodput_mode=None,
            router_tokens_ratio=None,
            router_goodput_ratio=None,
            router_worse=False,
        )
    fixed_tokens = max(eligible, key=lambda c: c.output_tokens_per_s)
    fixed_goodput = max(eligible, key=lambda c: c.goodput_rps)
    tokens_ratio = _ratio(router.output_tokens_per_s, fixed_tokens.output_tokens_per_s)
    goodput_ratio = _ratio(router.goodput_rps, fixed_goodput.goodput_rps)
    return LevelSummary(
        **base,
        best_tokens_mode=best_tokens.mode,
        best_goodput_mode=best_goodput.mode,
        best_fixed_tokens_mode=fixed_tokens.mode,
        best_fixed_goodput_mode=fixed_goodput.mode,
        router_tokens_ratio=tokens_ratio,
        router_goodput_ratio=goodput_ratio,
        router_vs={c.mode: _ratio(router.output_tokens_per_s, c.output_tokens_per_s) for c in fixed},
        router_goodput_vs={c.mode: _ratio(router.goodput_rps, c.goodput_rps) for c in fixed},
        router_worse=any(r is not None and r < WORSE_BELOW for r in (tokens_ratio, goodput_ratio)),
    )


def _batching_comparisons(cells: list[CellStats]) -> list[BatchingComparison]:
    static = {(c.level, c.mode): c for c in cells if c.batching == "static"}
    comparisons = []
    for cell in cells:
        base = static.get((cell.level, cell.mode))
        if cell.batching != "continuous" or base is None:
            continue
        ttft = None
        if cell.ttft_ms.p50 is not None and base.ttft_ms.p50:
            ttft = cell.ttft_ms.p50 / base.ttft_ms.p50
        tokens = _ratio(cell.output_tokens_per_s, base.output_tokens_per_s)
        comparisons.append(
            BatchingComparison(level=cell.level, mode=cell.mode, tokens_ratio=tokens, ttft_p50_ratio=ttft)
        )
    return comparisons


def _ms(p: Percentiles, digits: int = 0) -> str:
    if p.p50 is None or p.p99 is None:
        return "—"
    return f"{p.p50:.{digits}f} / {p.p99:.{digits}f}"


def _served(cell: CellStats) -> str:
    return " ".join(f"{name} {share:.0%}" for name, share in cell.served_by.items()) or "—"


HEADER = (
    f"  {'mode':<12} {'batching':<10} {'served by':<28} {'TTFT p50/p99':>15} {'TPOT p50/p99':>15} "
    f"{'e2e p50/p99':>17} {'tok/s':>8} {'goodput/s':>10} {'errors':>8} {'cached':>7} {'outside':>8}"
)


def _row(cell: CellStats) -> str:
    return (
        f"  {cell.mode:<12} {cell.batching:<10} {_served(cell):<28} {_ms(cell.ttft_ms):>15} "
        f"{_ms(cell.tpot_ms, 1):>15} {_ms(cell.e2e_ms):>17} {cell.output_tokens_per_s:8.1f} "
        f"{cell.goodput_rps:10.2f} {f'{cell.errors}/{cell.requests}':>8} {_share(cell.cached_share):>7} "
        f"{'—' if cell.outside_ms is None else f'{cell.outside_ms:.0f} ms':>8}"
    )


def _share(share: float | None) -> str:
    return "—" if share is None else f"{share:.0%}"


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}×"


def _comparison(report: LoadReport, summary: LevelSummary) -> list[str]:
    at = summary.level.label + ("" if summary.batching == "continuous" else f" ({summary.batching})")
    best = f"{at}: best overall: tok/s {summary.best_tokens_mode}, goodput {summary.best_goodput_mode}"
    if summary.best_fixed_tokens_mode is None or summary.best_fixed_goodput_mode is None:
        return [f"{best}; router not compared (needs auto and a forced backend)"]
    router = report.cell(ROUTER, summary.level, summary.batching)
    fixed = report.cell(summary.best_fixed_tokens_mode, summary.level, summary.batching)
    good = report.cell(summary.best_fixed_goodput_mode, summary.level, summary.batching)
    each = ", ".join(
        f"{mode} {_times(ratio)} ({_times(summary.router_goodput_vs.get(mode))} goodput)"
        for mode, ratio in summary.router_vs.items()
    )
    return [
        f"{at}: best fixed {fixed.mode} {fixed.output_tokens_per_s:.1f} tok/s; "
        f"router {router.output_tokens_per_s:.1f} tok/s = {_times(summary.router_tokens_ratio)}",
        f"{at}: best fixed by goodput {good.mode} {good.goodput_rps:.2f}/s; "
        f"router {router.goodput_rps:.2f}/s = {_times(summary.router_goodput_ratio)}",
        f"{at}: router tok/s over each fixed backend: {each}",
        best,
    ]


def _worse_line(report: LoadReport) -> str:
    if all(level.best_fixed_tokens_mode is None for level in report.levels):
        return "router vs fixed backends: not compared (run auto and at least one forced backend)"
    worse = []
    for level in (lv for lv in report.levels if lv.router_worse):
        metrics = [
            f"{name} {_times(ratio)}"
            for name, ratio in (("tok/s", level.router_tokens_ratio), ("goodput", level.router_goodput_ratio))
            if ratio is not None and ratio < WORSE_BELOW
        ]
        batching = "" if level.batching == "continuous" else f" {level.batching}"
        worse.append(f"{level.level.label}{batching} ({', '.join(metrics)})")
    floor = f", not counting {', '.join(report.below_quality_floor)} (under the quality floor)"
    within = f"(by more than {1 - WORSE_BELOW:.0%}{floor if report.below_quality_floor else ''}) "
    return f"router worse than the best fixed backend {within}at: {', '.join(worse) or 'nowhere'}"


def _batching_lines(report: LoadReport) -> list[str]:
    if not report.batching:
        return []
    lines = ["", "step loop (continuous) over the static baseline, same run: tok/s ratio, TTFT p50 ratio"]
    for level in report.config.levels():
        parts = [
            f"{c.mode} {_times(c.tokens_ratio)} / {_times(c.ttft_p50_ratio)}"
            for c in report.batching
            if c.level == level
        ]
        lines.append(f"  {level.label}: " + ", ".join(parts))
    return lines


def _join_lines(report: LoadReport) -> list[str]:
    if not report.join:
        return []
    lines = ["", "join probe: a short request arriving while a long one decodes, against the same request alone"]
    for probe in report.join:
        idle = "—" if probe.idle_ttft_ms is None else f"{probe.idle_ttft_ms:.0f}"
        joined = "—" if probe.joined_ttft_ms is None else f"{probe.joined_ttft_ms:.0f}"
        text = "same text" if probe.same_text else "DIFFERENT TEXT"
        error = f" — error: {probe.error}" if probe.error else ""
        lines.append(
            f"  {probe.mode:<12} {probe.batching:<10} TTFT alone {idle} ms, joined {joined} ms "
            f"= {_times(probe.ttft_ratio)}; {text}{error}"
        )
    return lines


def render_load(report: LoadReport) -> str:
    cfg = report.config
    loop = "open loop (Poisson arrivals)" if cfg.open_loop else "closed loop"
    lines = [
        f"specroute bench load — {report.model} at {cfg.url}, started {report.started}",
        f"{loop}, workload {cfg.workload}, {cfg.max_tokens} max tokens, SLO: TTFT ≤ {cfg.slo_ttft_ms:g} ms and "
        f"TPOT ≤ {cfg.slo_tpot_ms:g} ms; latencies in ms",
    ]
    for level in cfg.levels():
        cells = [c for c in report.cells if c.level == level]
        if not cells:
            continue
        lines += ["", f"{level.label} ({cells[0].requests} requests per mode)", HEADER]
        lines += [_row(c) for c in cells]
        for summary in (s for s in report.levels if s.level == level):
            lines += ["  " + line for line in _comparison(report, summary)]
    lines += _batching_lines(report) + _join_lines(report)
    lines += ["", _worse_line(report)]
    return "\n".join(lines)
