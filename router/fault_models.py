"""What `specroute bench faults` is asked to do, what it records, and the figures it computes from
the records: per fault, the window from the fault to the recovery, and in it the requests lost,
the errors, the latency, and the greedy answers that differ from the undisturbed run's.

Pure functions of records and events, so tests check every figure on synthetic records."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .load_report import Percentiles, percentiles

Route = Literal["auto", "speculative", "plain", "quantized"]
FaultName = Literal["speculative", "plain", "quantized", "policy"]
FAULTS: tuple[FaultName, ...] = ("speculative", "plain", "quantized", "policy")
Phase = Literal["undisturbed", "faulted"]
# Every request gets exactly one: together they account for all requests sent.
Outcome = Literal["ok", "lost", "server_error", "client_error", "overloaded"]
# PolicyConfig refuses a boolean it cannot read, so the Router keeps its last good policy.
BAD_POLICY = {"speculation": {"enabled": "maybe"}}


class FaultsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: int = Field(1000, ge=4, description="requests per run; the same list runs undisturbed, then faulted")
    concurrency: int = Field(32, ge=1, le=1024, description="closed-loop clients")
    max_tokens: int = Field(24, ge=1, le=1024)
    faults: list[FaultName] = Field(default_factory=lambda: list(FAULTS), min_length=1, max_length=4)
    routes: list[Route] = Field(
        default_factory=lambda: ["auto"],
        min_length=1,
        description="requests cycle through these: 'auto' lets the router decide; a backend forces it, so that "
        "its kill meets requests in flight even when the router sends it none",
    )
    profile: str | None = Field(None, description="profile JSON (default: the machine's, measured if missing)")
    port: int = Field(8000, ge=1, le=65535, description="port of the service the bench starts")
    sampled_temperature: float = Field(0.8, gt=0.0, le=2.0)
    seed: int = Field(0, ge=0, description="request i of a sampled kind is seeded seed + i, in both runs")
    probe_interval_s: float = Field(0.5, gt=0, description="between recovery probes")
    policy_hold_s: float = Field(5.0, ge=0, description="how long the refused policy stays applied")
    recovery_timeout_s: float = Field(300.0, gt=0, description="a fault not recovered by then is reported so")
    timeout_s: float = Field(300.0, gt=0, description="whole-request deadline, stream included")

    @field_validator("faults", "routes")
    @classmethod
    def _distinct(cls, names: list[str]) -> list[str]:
        if len(set(names)) != len(names):
            raise ValueError(f"must not repeat (got {names})")
        return names

    def fire_after(self) -> list[int]:
        """Completed requests after which each fault fires: 15 %, 35 %, 55 %, 75 % of the run."""
        return [math.ceil(self.requests * (15 + 20 * i) / 100) for i in range(len(self.faults))]


class FaultRequestRecord(BaseModel):
    index: int = Field(description="position in the request list: the same request in both runs")
    phase: Phase
    category: str
    prompt_id: str
    route: Route = Field("auto", description="the backend asked for")
    stream: bool
    greedy: bool
    start_s: float = Field(description="seconds after the start of its run")
    end_s: float = Field(description="when it was answered, failed or given up")
    outcome: Outcome
    status: int | None = Field(description="HTTP status; None when no response came")
    error: str | None = None
    text: str = ""
    completion_tokens: int = 0
    backend: str | None = Field(None, description="the backend that finished it, as the service reported")
    weights: str | None = Field(None, description="what that backend computes in: a dtype or a quantization method")
    retried: bool | None = Field(None, description="the service's `specroute.retried`")

    @property
    def e2e_ms(self) -> float:
        return (self.end_s - self.start_s) * 1e3


class FaultEvent(BaseModel):
    """One fault as it happened; times in seconds after the start of the faulted run."""

    fault: FaultName
    fired_after: int = Field(description="requests completed when it fired")
    fired_s: float
    pid: int | None = Field(None, description="the replica process killed")
    recovered_s: float | None = Field(
        description="kills: the first forced request to that backend answered without a retry; policy: /healthz "
        "200 again after the good policy was restored. None: not within the recovery timeout"
    )
    refused_s: float | None = Field(None, description="policy: /healthz first showed the refusal")
    refused_status: int | None = Field(None, description="policy: the /healthz status with the refusal showing")
    restored_s: float | None = Field(None, description="policy: the good policy applied again")


class Figures(BaseModel):
    requests: int
    completed: int
    lost: int = Field(description="sent, never answered: dropped connection, cut stream, timeout")
    server_errors: int = Field(description="HTTP 5xx, and error events inside a 200 stream")
    client_errors: int = Field(description="HTTP 4xx other than 429")
    overloaded: int = Field(description="HTTP 429: backpressure")
    retried: int = Field(description="completed requests the service retried on another replica")
    e2e_ms: Percentiles = Field(description="completed requests")
    greedy_compared: int = Field(description="greedy requests completed in both runs on the same weights")
    greedy_differing: int
    greedy_other_weights: int = Field(description="greedy, completed in both runs, but served in different weights")
    sampled_completed: int
    served_by: dict[str, float] = Field(description="share of completed requests per backend that finished them")


class FaultFigures(BaseModel):
    event: FaultEvent
    window_s: tuple[float, float] = Field(description="from the fault to its recovery (or the run's end)")
    recovery_s: float | None
    figures: Figures = Field(description="requests in flight or started in the window")
    undisturbed_e2e_ms: Percentiles = Field(description="the same requests in the undisturbed run")


class FaultsReport(BaseModel):
    config: FaultsConfig
    model: str
    weights: str = Field(description="the dtype the exact backends serve")
    started: str = Field(description="UTC, ISO 8601")
    wall_s: dict[Phase, float]
    undisturbed: Figures
    faulted: Figures
    outside_windows: Figures = Field(description="the faulted run's requests outside every fault window")
    faults: list[FaultFigures]
    not_fired: list[FaultName] = Field(description="faults the run ended before (too few requests)")
    differing: list[int] = Field(description="indices of greedy requests whose output differs")
    records: list[FaultRequestRecord]


def in_window(records: Iterable[FaultRequestRecord], start: float, end: float) -> list[FaultRequestRecord]:
    """Requests in flight at some moment of [start, end]: started by its end, not finished before its start."""
    return [r for r in records if r.start_s <= end and r.end_s >= start]


def greedy_comparison(record: FaultRequestRecord, baseline: dict[int, FaultRequestRecord]) -> str | None:
    """'same', 'different' or 'other-weights' against the undisturbed run; None when not comparable
    (sampled, or not completed in both runs). Different weights (the float target against the
    quantized model) are different models, whose greedy answers may differ without any fault."""
    before = baseline.get(record.index)
    if not record.greedy or record.outcome != "ok" or before is None or before.outcome != "ok":
        return None
    if record.weights != before.weights:
        return "other-weights"
    return "same" if record.text == before.text else "different"


def figures(records: list[FaultRequestRecord], baseline: dict[int, FaultRequestRecord]) -> Figures:
    outcomes = [r.outcome for r in records]
    done = [r for r in records if r.outcome == "ok"]
    compared = [greedy_comparison(r, baseline) for r in records]
    return Figures(
        requests=len(records),
        completed=len(done),
        lost=outcomes.count("lost"),
        server_errors=outcomes.count("server_error"),
        client_errors=outcomes.count("client_error"),
        overloaded=outcomes.count("overloaded"),
        retried=sum(1 for r in done if r.retried),
        e2e_ms=percentiles([r.e2e_ms for r in done]),
        greedy_compared=compared.count("same") + compared.count("different"),
        greedy_differing=compared.count("different"),
        greedy_other_weights=compared.count("other-weights"),
        sampled_completed=sum(1 for r in done if not r.greedy),
        served_by={name: n / len(done) for name, n in Counter(r.backend or "?" for r in done).most_common()},
    )


def fault_figures(
    event: FaultEvent, faulted: list[FaultRequestRecord], baseline: dict[int, FaultRequestRecord], run_end_s: float
) -> FaultFigures:
    end = event.recovered_s if event.recovered_s is not None else max(run_end_s, event.fired_s)
    window = in_window(faulted, event.fired_s, end)
    same_requests = [baseline[r.index] for r in window if r.index in baseline and baseline[r.index].outcome == "ok"]
    return FaultFigures(
        event=event,
        window_s=(event.fired_s, end),
        recovery_s=event.recovered_s - event.fired_s if event.recovered_s is not None else None,
        figures=figures(window, baseline),
        undisturbed_e2e_ms=percentiles([r.e2e_ms for r in same_requests]),
    )


def build_report(
    config: FaultsConfig,
    model: str,
    weights: str,
    started: str,
    runs: dict[Phase, tuple[list[FaultRequestRecord], float]],
    events: list[FaultEvent],
) -> FaultsReport:
    """`runs`: each run's records and wall seconds."""
    undisturbed, faulted = runs["undisturbed"][0], runs["faulted"][0]
    baseline = {r.index: r for r in undisturbed}
    per_fault = [fault_figures(e, faulted, baseline, runs["faulted"][1]) for e in events]
    windowed = {r.index for f in per_fault for r in in_window(faulted, *f.window_s)}
    return FaultsReport(
        config=config,
        model=model,
        weights=weights,
        started=started,
        wall_s={phase: wall for phase, (_, wall) in runs.items()},
        undisturbed=figures(undisturbed, {}),
        faulted=figures(faulted, baseline),
        outside_windows=figures([r for r in faulted if r.index not in windowed], baseline),
        faults=per_fault,
        not_fired=config.faults[len(events) :],
        differing=sorted(r.index for r in faulted if greedy_comparison(r, baseline) == "different"),
        records=undisturbed + faulted,
    )


HEADER = (
    f"  {'window':<34} {'recovery s':>10} {'requests':>8} {'lost':>5} {'5xx':>4} {'4xx':>4} {'429':>4} "
    f"{'retried':>7} {'e2e p50/p99 ms':>15} {'same, undisturbed':>17} {'greedy differ':>13} {'sampled ok':>10} "
    " served by"
)


def render_faults(report: FaultsReport) -> str:
    cfg = report.config
    lines = [
        f"specroute bench faults — {report.model} ({report.weights}), started {report.started}",
        f"{cfg.requests} requests per run at concurrency {cfg.concurrency}, ≤ {cfg.max_tokens} tokens, "
        f"routed {'/'.join(cfg.routes)}; "
        f"streaming/non-streaming × greedy/sampled (T = {cfg.sampled_temperature:g}, seeded) in turn; "
        f"runs took {report.wall_s['undisturbed']:.0f} s undisturbed, {report.wall_s['faulted']:.0f} s faulted",
        "",
        HEADER,
        _row("undisturbed run", None, report.undisturbed, None),
        _row("faulted run", None, report.faulted, None),
    ]
    lines += [_row(_label(f.event), f.recovery_s, f.figures, f.undisturbed_e2e_ms) for f in report.faults]
    lines += [_row("faulted run, outside fault windows", None, report.outside_windows, None), ""]
    lines += [_note(f) for f in report.faults if _note(f)]
    if report.not_fired:
        lines.append(f"not fired (the run ended first; give more --requests): {', '.join(report.not_fired)}")
    lines.append(_goals(report))
    return "\n".join(lines)


def _label(event: FaultEvent) -> str:
    what = "invalid policy deployed" if event.fault == "policy" else f"SIGKILL {event.fault} (pid {event.pid})"
    return f"{what} @{event.fired_after}"


def _row(label: str, recovery_s: float | None, f: Figures, same: Percentiles | None) -> str:
    recovery = "—" if recovery_s is None else f"{recovery_s:.1f}"
    greedy = f"{f.greedy_differing}/{f.greedy_compared}" if f.greedy_compared or f.greedy_differing else "—"
    return (
        f"  {label:<34} {recovery:>10} {f.requests:>8} {f.lost:>5} {f.server_errors:>4} {f.client_errors:>4} "
        f"{f.overloaded:>4} {f.retried:>7} {_p50_p99(f.e2e_ms):>15} {_p50_p99(same):>17} {greedy:>13} "
        f"{f.sampled_completed:>10}  {_served(f)}"
    )


def _served(f: Figures) -> str:
    return " ".join(f"{name} {share:.0%}" for name, share in f.served_by.items()) or "—"


def _p50_p99(p: Percentiles | None) -> str:
    if p is None or p.p50 is None or p.p99 is None:
        return "—"
    return f"{p.p50:.0f} / {p.p99:.0f}"


def _note(f: FaultFigures) -> str:
    e = f.event
    if e.recovered_s is None:
        return f"{_label(e)}: not recovered within the timeout; its window runs to the end of the run"
    if e.fault != "policy":
        return ""
    shown = "never" if e.refused_s is None else f"after {e.refused_s - e.fired_s:.1f} s (HTTP {e.refused_status})"
    restored = e.restored_s if e.restored_s is not None else e.fired_s  # set whenever it recovered
    return (
        f"invalid policy: /healthz showed the refusal {shown}; the good policy was restored "
        f"{restored - e.fired_s:.1f} s after the fault, and /healthz answered 200 "
        f"{e.recovered_s - restored:.1f} s later"
    )


def _goals(report: FaultsReport) -> str:
    f = report.faulted
    other = f" ({f.greedy_other_weights} more served in other weights, not compared)" if f.greedy_other_weights else ""
    return (
        f"faulted run: {f.lost} lost, {f.server_errors} 5xx, {f.greedy_differing} of {f.greedy_compared} greedy "
        f"outputs differ from the undisturbed run{other} (goal: 0, 0, 0)"
    )
