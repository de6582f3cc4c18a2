"""The report's second half, simulated: the workload drawn as requests, replayed through the
router and backends (`policies.simulation` with `policies.capacity`'s models) — first against
every measured `bench load` cell, so the report shows how far to trust it, then to size the
replicas each backend needs for the workload's load and SLO, with memory and cost, and for the
what-ifs (more replicas, more load, another machine's profile)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import ValidationError
from tqdm import tqdm

from backends.scheduler import LoopSettings
from policies.capacity import (
    Acceptance,
    RunSummary,
    backend_of,
    kv_bytes,
    router_for,
    summarize,
    usd_per_million,
)
from policies.config import PolicyConfig
from policies.policy import RequestFeatures
from policies.profile import Profile
from policies.simulation import (
    LoopLimits,
    SimRecord,
    SimRequest,
    poisson_arrivals,
    simulate_closed,
    simulate_open,
    with_arrivals,
)
from policies.workload import BACKENDS, Workload

from ..load_models import ROUTER
from ..load_report import CellStats, LoadReport
from . import data as r
from .inputs import Inputs, ReportConfig, ReportError, first_line

MODES = (ROUTER, *BACKENDS)  # the routed service first, then each backend alone


UNCLASSIFIED = "unclassified"  # the mix of a JSONL workload: its prompts carry no category
SIM_TOLERANCE = (
    0.25  # the mean |error| (closed-loop tokens/s, and e2e p50 on every cell) the simulation is trusted within
)


def loop_limits() -> LoopLimits:
    """The step loop's limits as a replica runs with its default settings."""
    s = LoopSettings()
    return LoopLimits(
        max_batch=s.max_batch, max_step_tokens=s.max_step_tokens, prefill_chunk=s.prefill_chunk, mirror_scheduler=True
    )


def _prompt_tokens(profile: Profile) -> dict[str, int]:
    return {s.prompt_id: s.prompt_tokens for s in profile.project_samples}


def _measured_acceptance(profile: Profile) -> dict[str, dict[str, Acceptance]]:
    """Per prompt id and drafter: the α and ρ the profile measured on that very prompt."""
    out: dict[str, dict[str, Acceptance]] = {}
    for s in profile.project_samples:
        out.setdefault(s.prompt_id, {})[s.drafter] = Acceptance(s.drafter, s.alpha, s.proposal_rate)
    return out


def validate(profile: Profile, policy: PolicyConfig, loads: list[LoadReport]) -> tuple[r.Validation, list[str]]:
    """Every measured continuous-batching cell replayed: the same prompts (their measured prompt
    lengths, α and ρ), the same answer lengths, the same concurrency or arrival times; with notes
    on cells it could not replay. Tokens/s is judged on closed loops only (an open loop's is set by
    its arrivals, so it would agree whatever the simulation did), e2e on every cell."""
    notes: list[str] = []
    for load in loads:
        if load.model != profile.model.name:
            raise ReportError(
                f"the bench load results of {load.started} measured {load.model}, the profile {profile.model.name}: "
                "pass results measured against the profiled model"
            )
    lengths, accepted = _prompt_tokens(profile), _measured_acceptance(profile)
    rows = []
    for load in loads:
        for cell in (c for c in load.cells if c.batching == "continuous"):
            if cell.mode == "quantized" and profile.quantized is None:
                notes.append(f"{cell.level.label} quantized not replayed: the profile measured no quantized backend")
            elif cell.requests == cell.errors:
                notes.append(f"{cell.level.label} {cell.mode} not replayed: every request failed")
            elif (row := _replay(profile, policy, load, cell, lengths, accepted)) is not None:
                rows.append(row)
            else:
                notes.append(f"{cell.level.label} {cell.mode} not replayed: no request produced a token")
    return _judged(rows), notes


def _judged(rows: list[r.ValidationRow]) -> r.Validation:
    closed = [x.tokens_error for x in rows if not x.open_loop]
    e2e = [x.e2e_error for x in rows if x.e2e_error is not None]
    mean_tokens = float(np.mean(np.abs(closed))) if closed else None
    mean_e2e = float(np.mean(np.abs(e2e))) if e2e else None
    judged = [m for m in (mean_tokens, mean_e2e) if m is not None]
    return r.Validation(
        rows=rows,
        mean_abs_tokens_error=mean_tokens,
        signed_tokens_error=float(np.mean(closed)) if closed else None,
        mean_abs_e2e_error=mean_e2e,
        signed_e2e_error=float(np.mean(e2e)) if e2e else None,
        tolerance=SIM_TOLERANCE,
        within_tolerance=all(m <= SIM_TOLERANCE for m in judged) if judged else None,
    )


def _replay(
    profile: Profile,
    policy: PolicyConfig,
    load: LoadReport,
    cell: CellStats,
    lengths: dict[str, int],
    accepted: dict[str, dict[str, Acceptance]],
) -> r.ValidationRow | None:
    """One measured cell through the simulator: its successful requests in the order they were
    sent, each with its prompt's profiled length, α and ρ and its measured answer length."""
    records = sorted(
        (x for x in load.records if (x.mode, x.level, x.batching) == (cell.mode, cell.level, cell.batching)),
        key=lambda x: x.start_s,
    )
    records = [x for x in records if x.error is None and x.completion_tokens > 0]
    if not records:
        return None
    open_loop = cell.level.request_rate is not None
    requests = [
        SimRequest(
            id=i,
            prompt_tokens=_length(lengths, x.prompt_id),
            output_tokens=x.completion_tokens,
            category=x.category,
            arrival_s=x.start_s if open_loop else None,
        )
        for i, x in enumerate(records)
    ]
    known = {i: accepted.get(x.prompt_id, {}) for i, x in enumerate(records)}
    route, backends, _ = router_for(profile, policy, cell.mode, 1, known)
    if open_loop:
        simulated = simulate_open(requests, backends, route, loop_limits())
    else:
        simulated = simulate_closed(requests, cell.level.concurrency or 1, backends, route, loop_limits())
    return _validation_row(cell, simulated)


def _length(lengths: dict[str, int], prompt_id: str) -> int:
    if prompt_id not in lengths:
        raise ReportError(
            f"bench load sent prompt {prompt_id!r}, which the profile has no sample of: replay needs its length"
        )
    return lengths[prompt_id]


def _validation_row(cell: CellStats, simulated: list[SimRecord]) -> r.ValidationRow:
    wall = max(x.finished_s for x in simulated)  # both clocks start with the cell
    sim_tokens = sum(x.request.output_tokens for x in simulated) / wall
    sim_e2e = float(np.median([x.e2e_s * 1e3 for x in simulated]))
    sim_ttft = float(np.median([x.ttft_s * 1e3 for x in simulated]))
    measured_e2e = cell.e2e_ms.p50
    return r.ValidationRow(
        level=cell.level.label,
        mode=cell.mode,
        open_loop=cell.level.request_rate is not None,
        measured_tokens_per_s=cell.output_tokens_per_s,
        simulated_tokens_per_s=sim_tokens,
        tokens_error=(sim_tokens - cell.output_tokens_per_s) / cell.output_tokens_per_s,
        measured_e2e_p50_ms=measured_e2e,
        simulated_e2e_p50_ms=sim_e2e,
        e2e_error=(sim_e2e - measured_e2e) / measured_e2e if measured_e2e else None,
        measured_ttft_p50_ms=cell.ttft_ms.p50,
        simulated_ttft_p50_ms=sim_ttft,
    )


@dataclass(frozen=True)
class Traffic:
    """The workload drawn as concrete requests (categories, lengths) and how they arrive."""

    requests: list[SimRequest]
    features: dict[int, RequestFeatures]
    acceptance: dict[int, dict[str, Acceptance]]
    mix: dict[str, float]
    rated: int | None  # prompts of a JSONL workload (None: a category mix)
    arrival_rate: float | None
    concurrency: list[int] | None

    def at(self, factor: float, seed: int) -> list[SimRequest]:
        """The requests with Poisson arrival times at `factor` × the workload's rate."""
        if self.arrival_rate is None:
            return list(self.requests)
        return with_arrivals(self.requests, poisson_arrivals(self.arrival_rate * factor, len(self.requests), seed))


def draw_traffic(workload: Workload, profile: Profile, n: int, seed: int, prompts: Sequence[Prompted] = ()) -> Traffic:
    rng = np.random.default_rng(seed)
    outputs = workload.output_tokens.sample(rng, n)
    if prompts:
        chosen = [prompts[i % len(prompts)] for i in range(n)]
        shared = workload.shared_prefix
        requests = [
            SimRequest(i, p.tokens, int(o), shared_prefix=shared)
            for i, (p, o) in enumerate(zip(chosen, outputs, strict=True))
        ]
        # One features object per prompt (the router's decisions are remembered per prompt and load).
        each = {
            id(p): RequestFeatures(prompt_tokens=p.tokens, max_tokens=workload.output_tokens.max, alphas=p.alphas)
            for p in prompts
        }
        features = {i: each[id(p)] for i, p in enumerate(chosen)}
        acceptance = {i: p.acceptance for i, p in enumerate(chosen)}
        return Traffic(requests, features, acceptance, {UNCLASSIFIED: 1.0}, len(prompts), *_load_of(workload))
    assert workload.mix is not None
    names = [c for c, share in workload.mix.items() if share > 0]
    shares = np.array([workload.mix[c] for c in names])
    categories = rng.choice(names, size=n, p=shares / shares.sum())
    inputs = _input_lengths(workload, profile, categories, rng)
    shared = workload.shared_prefix  # before each drawn prompt
    requests = [
        SimRequest(i, int(p) + shared, int(o), str(c), shared_prefix=shared)
        for i, (c, p, o) in enumerate(zip(categories, inputs, outputs, strict=True))
    ]
    return Traffic(requests, {}, {}, dict(workload.mix), None, *_load_of(workload))


def _load_of(workload: Workload) -> tuple[float | None, list[int] | None]:
    return workload.load.arrival_rate, workload.load.concurrency


def _input_lengths(workload: Workload, profile: Profile, categories: np.ndarray, rng: np.random.Generator) -> list[int]:
    """The workload's input distribution, or else each category's profiled prompt lengths."""
    if workload.input_tokens is not None:
        return workload.input_tokens.sample(rng, len(categories)).tolist()
    by_category: dict[str, list[int]] = {}
    for s in {s.prompt_id: s for s in profile.project_samples}.values():
        by_category.setdefault(s.category, []).append(s.prompt_tokens)
    missing = sorted({str(c) for c in categories} - set(by_category))
    if missing:
        raise ReportError(
            f"the profile has no prompt of {', '.join(missing)} to take lengths from: give input_tokens in the workload"
        )
    return [int(rng.choice(by_category[str(c)])) for c in categories]


@dataclass(frozen=True)
class Prompted:
    """One prompt of a JSONL workload file, as the router would see it (no category: its α and ρ
    are the predictors' for its text)."""

    tokens: int
    alphas: dict
    acceptance: dict[str, Acceptance]


def run_workload(
    profile: Profile,
    policy: PolicyConfig,
    traffic: Traffic,
    mode: str,
    replicas: int,
    factor: float,
    seed: int,
    slo: tuple[float, float],
) -> RunSummary:
    """One simulated run of the workload on `replicas` replicas of `mode`."""
    route, backends, router = router_for(profile, policy, mode, replicas, traffic.acceptance)
    router.features_of = traffic.features
    limits = loop_limits()
    if traffic.arrival_rate is not None:
        records = simulate_open(traffic.at(factor, seed), backends, route, limits)
    else:
        assert traffic.concurrency is not None
        clients = max(1, round(traffic.concurrency[1] * factor))
        records = simulate_closed(traffic.requests, clients, backends, route, limits)
    return summarize(records, slo[0], slo[1], replicas)


class Runs:
    """`run_workload` remembered per (profile, mode, replicas, load factor): the sizing, the
    what-if grid and their searches ask for many of the same runs, and each is deterministic."""

    def __init__(self, policy: PolicyConfig, traffic: Traffic, seed: int, slo: tuple[float, float]):
        self.policy, self.traffic, self.seed, self.slo = policy, traffic, seed, slo
        self.done: dict[tuple[int, str, int, float], RunSummary] = {}
        # (profile, mode) → the fewest replicas meeting the SLO at 1× (None: not even the most tried)
        self.fewest: dict[tuple[int, str], int | None] = {}

    def search_start(self, profile: Profile, mode: str, factor: float, most: int) -> tuple[int, int]:
        """Where the fewest-replicas search at `factor` × load may start, as (a count known to miss,
        a first guess), from the sizing at 1×: more load never needs fewer replicas, so one less
        than the fewest at 1× misses, and if no count met 1× only the largest is worth running."""
        key = (id(profile), mode)
        if factor <= 1 or key not in self.fewest:
            return 0, 1
        at_1x = self.fewest[key]
        if at_1x is None:
            return most - 1, most
        return at_1x - 1, math.ceil(at_1x * factor)

    def __call__(self, profile: Profile, mode: str, replicas: int, factor: float) -> RunSummary:
        key = (id(profile), mode, replicas, factor)
        if key not in self.done:
            traffic, seed = self.traffic, self.seed
            self.done[key] = run_workload(profile, self.policy, traffic, mode, replicas, factor, seed, self.slo)
        return self.done[key]


def _meets(summary: RunSummary, workload: Workload) -> bool:
    slo = workload.slo
    e2e_ok = slo.e2e_p99_ms is None or summary.e2e_ms[2] <= slo.e2e_p99_ms
    return summary.attainment >= slo.attainment and e2e_ok


def fewest_replicas(
    run: Callable[[int], RunSummary],
    meets: Callable[[RunSummary], bool],
    most: int,
    short: int = 0,
    guess: int = 1,
) -> tuple[int | None, RunSummary]:
    """The fewest replicas in short+1..most whose run meets the SLO (more replicas never hurt:
    from `guess`, doubling while short, then bisection), with that run; None and the largest run
    when even `most` does not. `short`: a count known to miss (0: none), as the fewest at a lower
    load, less one, is at a higher one."""
    tried: dict[int, RunSummary] = {}

    def at(n: int) -> RunSummary:
        if n not in tried:
            tried[n] = run(n)
        return tried[n]

    failed = min(short, most - 1)  # the largest count known to miss
    n = min(max(guess, failed + 1), most)
    while not meets(at(n)):
        if n >= most:
            return None, at(n)
        failed, n = n, min(n * 2, most)
    lo, hi = failed + 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(at(mid)):
            hi = mid
        else:
            lo = mid + 1
    return hi, at(hi)


def _ineligible(mode: str, profile: Profile, policy: PolicyConfig) -> str | None:
    """Why the policy does not allow serving this way (None: it does): a disabled backend, or the
    quantized one under the quality floor. The routed service always may: it falls back to plain."""
    enabled = {
        "speculative": policy.speculation.enabled,
        "plain": policy.batching.enabled,
        "quantized": policy.quantization.enabled,
    }
    if not enabled.get(mode, True):
        return "disabled by the policy"
    q = profile.quantized
    if mode == "quantized" and (q is None or not policy.quantization.meets_floor(q.agreement)):
        return "below quality floor"
    return None


def _modes(profile: Profile) -> list[str]:
    return [m for m in MODES if m != "quantized" or profile.quantized is not None]


def _memory(mode: str, profile: Profile, peak_rows: int, tokens_per_row: float) -> r.Memory:
    """One replica's memory: weights (+ drafters) + the target's KV cache for the most requests it
    held at once (every backend of a routed replica together), each at the workload's mean prompt
    + answer length. A routed replica is one of each backend."""
    parts = [mode] if mode != ROUTER else [m for m in BACKENDS if m != "quantized" or profile.quantized]
    weights: int | None = 0
    drafters: int | None = 0
    for part in parts:
        w = profile.quantized.weight_bytes if part == "quantized" and profile.quantized else profile.model.weight_bytes
        weights = None if weights is None or w is None else weights + w
        if part == "speculative":
            extra = [d.weight_bytes for d in profile.drafters]
            drafters = None if any(x is None for x in extra) else sum(x for x in extra if x is not None)
    kv = kv_bytes(profile.model.kv_bytes_per_token, peak_rows, tokens_per_row)
    known = [x for x in (weights, drafters, kv) if x is not None]
    total = sum(known) if len(known) == 3 else None
    return r.Memory(
        weights_bytes=weights, drafter_bytes=drafters, kv_bytes=kv, total_bytes=total, planned_batch=peak_rows
    )


@dataclass(frozen=True)
class Price:
    replica_hour_usd: float
    assumed_cores: int | None  # None: the workload gave this replica's price
    core_hour_usd: float | None


def replica_price(mode: str, workload: Workload, profile: Profile) -> Price:
    """What one replica of `mode` costs per hour. Unpriced, a replica is one machine like the
    profiled one — for the routed service too, whose three backends share it as `specroute serve`
    runs them (and as `bench load` measured them)."""
    pricing = workload.pricing
    given = pricing.replica_hour_usd.get(mode)
    if given is not None:
        return Price(given, None, None)
    cores = pricing.cores or int(profile.machine.get("logical_cores") or 1)
    return Price(cores * pricing.core_hour_usd, cores, pricing.core_hour_usd)


def _capacity(profile: Profile, policy: PolicyConfig, traffic: Traffic, mode: str) -> float:
    """Output tokens/s one replica sustains saturated: as many clients as its batch holds."""
    limits = loop_limits()
    route, backends, router = router_for(profile, policy, mode, 1, traffic.acceptance)
    router.features_of = traffic.features
    clients = limits.max_batch * (1 if mode != ROUTER else len({backend_of(k) for k in backends}))
    requests = traffic.requests[: 4 * clients]  # every client sends about four, so the batch stays full
    records = simulate_closed(requests, clients, backends, route, limits)
    return summarize(records, math.inf, math.inf, 1).tokens_per_s


def size(
    inputs: Inputs, traffic: Traffic, config: ReportConfig, progress: bool, runs: Runs
) -> tuple[list[r.SizingRow], dict[str, RunSummary]]:
    profile, policy, workload = inputs.profile, inputs.policy, inputs.workload
    rows, sized = [], {}
    tokens_per_row = float(np.mean([q.prompt_tokens + q.output_tokens for q in traffic.requests]))
    for mode in tqdm(_modes(profile), desc="sizing", unit="backend", disable=not progress, leave=False):

        def run(n: int, mode: str = mode) -> RunSummary:
            return runs(profile, mode, n, 1.0)

        replicas, summary = fewest_replicas(run, lambda s: _meets(s, workload), config.max_replicas)
        sized[mode] = summary
        runs.fewest[(id(profile), mode)] = replicas
        price = replica_price(mode, workload, profile)
        capacity = _capacity(profile, policy, traffic, mode)
        n = replicas or config.max_replicas
        rows.append(
            r.SizingRow(
                backend=mode,
                eligible=_ineligible(mode, profile, policy) is None,
                ineligible_reason=_ineligible(mode, profile, policy),
                replicas=replicas,
                replicas_tried=config.max_replicas,
                attainment=summary.attainment,
                ttft_p99_ms=summary.ttft_ms[2],
                tpot_p99_ms=summary.tpot_ms[2],
                e2e_p99_ms=summary.e2e_ms[2],
                tokens_per_s=summary.tokens_per_s,
                capacity_tokens_per_s=capacity,
                utilization=summary.busy_share,
                mean_requests=summary.mean_requests,
                memory=_memory(mode, profile, summary.peak_rows, tokens_per_row),
                replica_hour_usd=price.replica_hour_usd,
                price_assumed=price.assumed_cores is not None,
                assumed_cores=price.assumed_cores,
                assumed_core_hour_usd=price.core_hour_usd,
                usd_per_million_tokens=usd_per_million(n, price.replica_hour_usd, summary.tokens_per_s)
                if replicas
                else None,
                usd_per_million_tokens_busy=usd_per_million(1, price.replica_hour_usd, capacity),
            )
        )
    return rows, sized


def what_if(inputs: Inputs, traffic: Traffic, config: ReportConfig, progress: bool, runs: Runs) -> list[r.WhatIfRow]:
    """The workload's what-if grid (replicas × load factors, on this machine's profile and any
    compared one), and for every load factor but 1× the fewest replicas that meet the SLO (its
    search starts from the sizing at 1×: fewer never meet more load, and load × replicas is the
    first guess)."""
    workload = inputs.workload
    profiles = [("this machine", inputs.profile), *inputs.compare]
    factors = workload.what_if.load_factors
    grid = [
        (label, p, mode, n, factor)
        for label, p in profiles
        for mode in _modes(p)
        for factor in factors
        for n in [*workload.what_if.replicas, None if factor != 1 else 0]
        if n != 0
    ]
    rows = []
    for label, profile, mode, n, factor in tqdm(grid, desc="what-if", unit="run", disable=not progress, leave=False):

        def run(replicas: int, profile: Profile = profile, mode: str = mode, factor: float = factor) -> RunSummary:
            return runs(profile, mode, replicas, factor)

        if n is None:  # sized for this load
            short, guess = runs.search_start(profile, mode, factor, config.max_replicas)
            fewest, s = fewest_replicas(run, lambda x: _meets(x, workload), config.max_replicas, short, guess)
            replicas = fewest or config.max_replicas
            scenario = f"{factor:g}× load, fewest replicas meeting the SLO" + (
                "" if fewest else f" (none up to {config.max_replicas})"
            )
        else:
            s, replicas = run(n), n
            scenario = f"{factor:g}× load, {n} replica{'s' if n > 1 else ''}"
        rows.append(
            r.WhatIfRow(
                scenario=scenario + ("" if label == "this machine" else f", {label}"),
                backend=mode,
                replicas=replicas,
                load_factor=factor,
                profile=label,
                attainment=s.attainment,
                ttft_p99_ms=s.ttft_ms[2],
                tpot_p99_ms=s.tpot_ms[2],
                e2e_p99_ms=s.e2e_ms[2],
                tokens_per_s=s.tokens_per_s,
                meets_slo=_meets(s, workload),
            )
        )
    return rows


def read_prompts(path: str, profile: Profile, max_tokens: int, model: str | None) -> list[Prompted]:
    """A JSONL file of chat requests: each prompt's length and, per drafter, the α and ρ the
    profile's predictors give it (the router's own per-prompt predictions)."""
    from backends.generation import GenerationRequest
    from backends.models import load_tokenizer

    from ..advise import Predictors, request_features

    tokenizer, predictors = load_tokenizer(model), Predictors.from_profile(profile)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"the workload's prompts file {path} cannot be read: {exc}") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
            request = GenerationRequest(messages=body["messages"], max_tokens=max_tokens)
        except (json.JSONDecodeError, KeyError, TypeError, ValidationError) as exc:
            raise ReportError(
                f"{path}:{number}: not an OpenAI chat request with messages ({first_line(exc)})"
            ) from None
        features = request_features(request, None, profile, predictors, tokenizer, max_tokens)
        acceptance = {
            name: Acceptance(
                name, a.alpha, a.proposal_rate if a.proposal_rate is not None else profile.proposal_rate(name)
            )
            for name, a in features.alphas.items()
        }
        prompts.append(Prompted(features.prompt_tokens, dict(features.alphas), acceptance))
    if not prompts:
        raise ReportError(f"{path}: no prompts")
    return prompts
