"""Capacity planning from a profile: the simulator's backend models built from the measured cost
curves, the router as the policy decides, and the sizing arithmetic (replicas, memory, $ per
million tokens). Pure Python: `policies.simulation` runs the queues, this module says what each
pass costs and where each request goes.

The backend models are fluid: a speculative row advances its *expected* tokens per step, and the
step planner is the engine's own `plan_step`, fed the profile's α and ρ for the row's category
(or the prompt's measured ones) instead of the running estimates a replica keeps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import PolicyConfig
from .cost_model import RowOutlook, effective_seconds, plan_step, tokens_per_step
from .estimates import ProfileCosts, decode_context, prefill_scale
from .policy import Decision, LoadSnapshot, RequestFeatures, decide
from .profile import CostCurve, Profile
from .replicas import DEFAULT_ROUTING, ReplicaRouting, rank_replicas
from .simulation import BackendModel, Router, SimRecord, SimRequest

REPLICA_SEPARATOR = "#"  # backend key of replica i: "plain#0", "plain#1", …


@dataclass(frozen=True)
class Acceptance:
    """What one request's speculation is expected to achieve with its drafter."""

    drafter: str
    alpha: float
    proposal_rate: float


class CurveModel:
    """A backend whose decode step is one 1-token pass (the plain and the quantized backends).
    Prefill is the profile's prefill curve, scaled by `prefill_scale` at the step's concurrency
    (1 for the target's own curve)."""

    def __init__(self, profile: Profile, curve: CostCurve):
        self.profile, self.curve, self.prefill = profile, curve, profile.prefill
        self._steps: dict[tuple[int, int], float] = {}

    def prefill_seconds(self, tokens: int, running: int) -> float:
        return self.prefill.per_token(1, tokens) * prefill_scale(self.curve, self.profile.target, running + 1)

    def decode_step(self, rows: Sequence[SimRequest]) -> tuple[float, list[float]]:
        key = (len(rows), batch_context(rows))
        if key not in self._steps:
            b, context = key
            # Attention over the cache runs in float whatever the weights: context adds the target's seconds.
            grown = self.profile.pass_seconds(b, 1, context) - self.profile.target.at(b, 1)
            self._steps[key] = self.curve.at(b, 1) + grown
        return self._steps[key], [1.0] * len(rows)


# Contexts are rounded to this many tokens, so steps of batches whose contexts barely differ share one estimate.
CONTEXT_GRAIN = 32


def batch_context(rows: Sequence[SimRequest]) -> int:
    """The mean context the rows hold while they decode (fluid: each its prompt and half its answer)."""
    mean = sum(decode_context(r.prompt_tokens, r.output_tokens) for r in rows) / max(len(rows), 1)
    return max(CONTEXT_GRAIN, round(mean / CONTEXT_GRAIN) * CONTEXT_GRAIN)


class SpeculativeModel:
    """The speculative backend (or the quantized one speculating: its `curve`, its prefill scaled
    by `prefill_scale`, as CurveModel's): each step `plan_step` chooses every drafter's k for the live batch from the
    measured pass times by width and the drafters' step costs, as the replica's step loop does — but
    with each drafter's cost at the whole batch and no catch-up reading (see the report's notes);
    rows whose drafter is None ride as plain rows."""

    def __init__(
        self,
        profile: Profile,
        acceptance: Mapping[int, Acceptance],
        k_max: int,
        curve: CostCurve | None = None,
    ):
        self.costs, self.acceptance = ProfileCosts(profile), acceptance
        self.curve = curve or profile.target
        self.k_max = min(k_max, self.curve.max_width - 1)
        self.profile = profile
        self._cache: dict[tuple, tuple[float, dict[str | None, int]]] = {}
        self._costs: dict[tuple[int, int], tuple[list[float], dict[str, float]]] = {}

    def prefill_seconds(self, tokens: int, running: int) -> float:
        return self.profile.prefill.per_token(1, tokens) * prefill_scale(self.curve, self.profile.target, running + 1)

    def pass_seconds(self, batch: int, width: int, context: int) -> float:
        # Attention over the cache runs in float whatever the weights: context adds the target's seconds.
        grown = self.profile.pass_seconds(batch, width, context) - self.profile.target.at(batch, width)
        return self.curve.at(batch, width) + grown

    def decode_step(self, rows: Sequence[SimRequest]) -> tuple[float, list[float]]:
        outlooks = [self._outlook(r) for r in rows]
        context = batch_context(rows)
        key = (context, *sorted((o.drafter or "", o.alpha, o.proposal_rate) for o in outlooks))
        if key not in self._cache:
            self._cache[key] = self._plan(outlooks, context)
        seconds, k_of = self._cache[key]
        return seconds, [
            tokens_per_step(o.alpha, k_of[o.drafter], o.proposal_rate) if k_of.get(o.drafter) else 1.0 for o in outlooks
        ]

    def _outlook(self, request: SimRequest) -> RowOutlook:
        chosen = self.acceptance.get(request.id)
        if chosen is None:
            return RowOutlook(drafter=None, alpha=0.0, proposal_rate=0.0, k_cap=0)
        return RowOutlook(chosen.drafter, chosen.alpha, chosen.proposal_rate, self.k_max)

    def _costs_at(self, b: int, context: int) -> tuple[list[float], dict[str, float]]:
        """Pass seconds by width and each drafter's step seconds at batch `b` over `context`: the
        same for every composition of a batch that size (the plans differ, these do not)."""
        key = (b, context)
        if key not in self._costs:
            passes = [self.pass_seconds(b, w, context) for w in self.curve.widths]
            self._costs[key] = passes, {d.name: d.step_at(b) for d in self.profile.drafters}
        return self._costs[key]

    def _plan(self, outlooks: list[RowOutlook], context: int) -> tuple[float, dict[str | None, int]]:
        """The k `plan_step` gives each drafter, and the step's expected seconds with them:
        drafting, then a wide pass unless no row proposed (probability Π(1 − ρ) over the drafting
        rows), else a 1-token pass; every pass over `context` cached tokens a row."""
        b = len(outlooks)
        passes, drafts = self._costs_at(b, context)
        ks = plan_step(outlooks, passes, drafts, self.k_max)
        k_of: dict[str | None, int] = {}
        for o, k in zip(outlooks, ks, strict=True):
            k_of[o.drafter] = max(k_of.get(o.drafter, 0), k)
        t = effective_seconds(passes)
        drafting = sum(k * drafts.get(d, 0.0) for d, k in k_of.items() if d is not None)
        silent = float(np.prod([1 - o.proposal_rate for o, k in zip(outlooks, ks, strict=True) if k]))
        width = 1 + max(ks, default=0)
        seconds = drafting + (1 - silent) * t[width - 1] + silent * t[0]
        return seconds, k_of


def backend_model(profile: Profile, backend: str, acceptance: Mapping[int, Acceptance], k_max: int) -> BackendModel:
    """The simulator's model of one replica of `backend`."""
    if backend == "plain":
        return CurveModel(profile, profile.target)
    if backend == "quantized":
        q = profile.quantized
        if q is None:
            raise ValueError("the profile has no quantized backend measured")
        if q.acceptance and q.curve.max_width > 1:  # it speculates: rows the policy sent with a drafter draft
            return SpeculativeModel(profile, acceptance, k_max, q.curve)
        return CurveModel(profile, q.curve)
    if backend == "speculative":
        return SpeculativeModel(profile, acceptance, k_max)
    raise ValueError(f"unknown backend {backend!r}")


def replica_key(backend: str, index: int) -> str:
    return f"{backend}{REPLICA_SEPARATOR}{index}"


def backend_of(key: str) -> str:
    return key.split(REPLICA_SEPARATOR, 1)[0]


@dataclass
class PolicyRouter:
    """Routes as the service does: `mode` "auto" asks `decide` with the live in-flight count of
    every backend per replica (the load one machine, a replica of each backend, sees), a forced
    mode takes that backend (and, forced speculative, the drafter the policy rates best). Within a
    backend `rank_replicas` picks the replica, as the service's request router does: one that
    already holds the workload's shared prefix unless it is too much busier than the least loaded.
    Each speculative request's drafter, α and ρ are recorded for the speculative model to read."""

    profile: Profile
    policy: PolicyConfig
    mode: str
    replicas: int = 1
    acceptance_of: Mapping[int, Mapping[str, Acceptance]] = field(default_factory=dict)
    features_of: Mapping[int, RequestFeatures] = field(default_factory=dict)  # per-prompt predictions, if any
    chosen: dict[int, Acceptance] = field(default_factory=dict)
    routing: ReplicaRouting = DEFAULT_ROUTING
    _prefilled: set[str] = field(default_factory=set, repr=False)  # replicas sent a shared prefix: it is cached there
    _decisions: dict[tuple, Decision] = field(default_factory=dict, repr=False)

    def __call__(self, request: SimRequest, in_flight: Mapping[str, int]) -> str:
        backend, drafter, decision = self._decide(request, in_flight)
        if backend == "speculative" and drafter is not None:
            self.chosen[request.id] = self._acceptance(request, drafter)
        elif backend == "quantized" and drafter is not None and decision is not None:  # the policy's α for it
            stacked = decision.chosen()
            self.chosen[request.id] = Acceptance(drafter, stacked.alpha or 0.0, stacked.proposal_rate)
        keys = [replica_key(backend, i) for i in range(self.replicas)]
        cached = {k: request.shared_prefix for k in keys if k in self._prefilled}
        chosen = rank_replicas(keys, in_flight, cached, self.routing)[0]
        if request.shared_prefix:
            self._prefilled.add(chosen)
        return chosen

    def _decide(self, request: SimRequest, in_flight: Mapping[str, int]) -> tuple[str, str | None, Decision | None]:
        if self.mode not in ("auto", "speculative"):
            return self.mode, None, None  # a forced plain or quantized mode needs no decision
        per_backend: dict[str, int] = {}
        for key, n in in_flight.items():
            per_backend[backend_of(key)] = per_backend.get(backend_of(key), 0) + n
        decision = self._decision(request, per_backend)
        if self.mode == "auto":
            return decision.backend, decision.drafter, decision
        specs = [c for c in decision.candidates if c.backend == "speculative"]
        best = max(specs, key=lambda c: c.speedup, default=None)
        return "speculative", best.drafter if best else None, decision

    def _decision(self, request: SimRequest, per_backend: dict[str, int]) -> Decision:
        """`decide` for this request at this load, remembered: the same prompt (length, category,
        predictions) at the same concurrency (all `decide` reads of the load) gets the same
        decision. max_tokens only moves the predicted e2e latency, which no stage decides on, so it
        is not part of the key."""
        features = self.features_of.get(request.id)
        load = LoadSnapshot(in_flight=per_backend, replicas=dict.fromkeys(per_backend, self.replicas))
        key = (request.category, request.prompt_tokens, id(features), load.concurrency)
        if key not in self._decisions:
            features = features or RequestFeatures(
                prompt_tokens=request.prompt_tokens, max_tokens=request.output_tokens, category=request.category
            )
            self._decisions[key] = decide(features, load, self.profile, self.policy, break_even=False)
        return self._decisions[key]

    def _acceptance(self, request: SimRequest, drafter: str) -> Acceptance:
        measured = self.acceptance_of.get(request.id, {}).get(drafter)
        if measured is not None:
            return measured
        if request.category is None:
            raise ValueError(f"request {request.id} has neither a category nor an acceptance for {drafter}")
        a = self.profile.acceptance_for(request.category, drafter)
        return Acceptance(drafter, a.alpha, a.proposal_rate)


def backends_for(
    profile: Profile, router: PolicyRouter, modes: Sequence[str], replicas: int, k_max: int
) -> dict[str, BackendModel]:
    """One model per replica of every backend the mode can reach (auto: all profiled ones)."""
    names = ["speculative", "plain"] + (["quantized"] if profile.quantized is not None else [])
    reach = names if "auto" in modes else list(modes)
    return {replica_key(b, i): backend_model(profile, b, router.chosen, k_max) for b in reach for i in range(replicas)}


def router_for(
    profile: Profile,
    policy: PolicyConfig,
    mode: str,
    replicas: int = 1,
    acceptance_of: Mapping[int, Mapping[str, Acceptance]] | None = None,
) -> tuple[Router, dict[str, BackendModel], PolicyRouter]:
    """The router and the backend models that serve `mode` with `replicas` replicas each."""
    router = PolicyRouter(profile, policy, mode, replicas, acceptance_of or {})
    return router, backends_for(profile, router, [mode], replicas, policy.speculation.k_max), router


# -- what a simulated run says ----------------------------------------------------------------------


@dataclass(frozen=True)
class RunSummary:
    """A simulated (or measured) run in the report's terms."""

    requests: int
    tokens_per_s: float
    ttft_ms: tuple[float, float, float]  # p50, p90, p99
    tpot_ms: tuple[float, float, float]
    e2e_ms: tuple[float, float, float]
    attainment: float  # share meeting both the TTFT and the TPOT target
    busy_share: float  # replica-time with a request admitted, over the replicas' wall time
    mean_requests: float  # requests admitted per replica, averaged over the run
    peak_rows: int  # most requests any one replica (all its backends) held at once


def summarize(records: Sequence[SimRecord], ttft_ms: float, tpot_ms: float, replicas: int) -> RunSummary:
    start = min(r.arrival_s for r in records)
    end = max(r.finished_s for r in records)
    wall = max(end - start, 1e-9)
    tokens = sum(r.request.output_tokens for r in records)
    ttft = [r.ttft_s * 1e3 for r in records]
    tpot = [r.tpot_s * 1e3 for r in records if r.tpot_s is not None]
    e2e = [r.e2e_s * 1e3 for r in records]
    met = sum(r.ttft_s * 1e3 <= ttft_ms and (r.tpot_s is None or r.tpot_s * 1e3 <= tpot_ms) for r in records)
    return RunSummary(
        requests=len(records),
        tokens_per_s=tokens / wall,
        ttft_ms=_pcts(ttft),
        tpot_ms=_pcts(tpot),
        e2e_ms=_pcts(e2e),
        attainment=met / len(records),
        busy_share=_busy(records) / (wall * replicas),
        mean_requests=sum(r.finished_s - r.admitted_s for r in records) / (wall * replicas),
        peak_rows=_peak(records),
    )


def _pcts(values: Sequence[float]) -> tuple[float, float, float]:
    if not values:
        return (0.0, 0.0, 0.0)
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return (p50, p90, p99)


def _busy(records: Sequence[SimRecord]) -> float:
    """Seconds, summed over replicas, in which a replica had at least one admitted request. A
    routed replica (one of each backend, on one machine) is busy while any of its backends is."""
    total = 0.0
    for index in {_replica_index(r.backend) for r in records}:
        spans = sorted((r.admitted_s, r.finished_s) for r in records if _replica_index(r.backend) == index)
        lo, hi = spans[0]
        for a, b in spans[1:]:
            if a > hi:
                total += hi - lo
                lo, hi = a, b
            else:
                hi = max(hi, b)
        total += hi - lo
    return total


def _replica_index(key: str) -> str:
    return key.rsplit(REPLICA_SEPARATOR, 1)[-1]


def _peak(records: Sequence[SimRecord]) -> int:
    """Most requests one replica — every backend of a routed one together — held (admitted, not
    finished) at once; each backend loop admits at most its max_batch, so this is bounded too."""
    peak = 0
    for index in {_replica_index(r.backend) for r in records}:
        mine = [r for r in records if _replica_index(r.backend) == index]
        # At equal times a finish sorts before an admission: the step loop frees a row first.
        events = sorted([(r.admitted_s, 1) for r in mine] + [(r.finished_s, -1) for r in mine])
        level = 0
        for _, change in events:
            level += change
            peak = max(peak, level)
    return peak


def usd_per_million(replicas: int, replica_hour: float, tokens_per_s: float) -> float | None:
    """$ per million output tokens when `replicas` replicas serve `tokens_per_s` in total."""
    if tokens_per_s <= 0:
        return None
    return replicas * replica_hour / (tokens_per_s * 3600) * 1e6


def kv_bytes(per_token: int | None, rows: int, tokens_per_row: float) -> int | None:
    return None if per_token is None else int(math.ceil(per_token * rows * tokens_per_row))
