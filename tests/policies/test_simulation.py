"""The step-loop simulation: queueing closed forms (M/M/1, M/D/1), hand-computed step timelines,
and an independent step-by-step reference the event-skipping simulator must match exactly."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from policies import simulation
from policies.simulation import (
    LoopLimits,
    SimRecord,
    SimRequest,
    least_loaded,
    poisson_arrivals,
    simulate_closed,
    simulate_open,
    with_arrivals,
)


@dataclass
class Linear:
    """prefill: fixed + per_token·tokens (+ per_running·running); decode: fixed + per_row·rows, and
    1 + gain·α tokens for a row with an α (a speculative row), 1 for the others. Records its calls."""

    prefill_fixed: float = 0.0
    prefill_per_token: float = 0.001
    prefill_per_running: float = 0.0
    decode_fixed: float = 0.01
    decode_per_row: float = 0.0
    gain: float = 0.0
    drafting: float = 0.0  # extra seconds of a pass in which some row speculates
    prefills: list[tuple[int, int]] = field(default_factory=list)
    decodes: int = 0

    def prefill_seconds(self, tokens: int, running: int) -> float:
        self.prefills.append((tokens, running))
        return self.prefill_fixed + self.prefill_per_token * tokens + self.prefill_per_running * running

    def decode_step(self, rows: Sequence[SimRequest]) -> tuple[float, list[float]]:
        self.decodes += 1
        speculating = any(r.alpha is not None for r in rows)
        seconds = self.decode_fixed + self.decode_per_row * len(rows) + (self.drafting if speculating else 0.0)
        return seconds, [1.0 + self.gain * (r.alpha or 0.0) for r in rows]


def one(model: Linear) -> dict[str, Linear]:
    return {"only": model}


ROUTE_ONE = least_loaded(["only"])


def by_id(records: Sequence[SimRecord]) -> dict[int, SimRecord]:
    return {rec.request.id: rec for rec in records}


# -- queueing closed forms ------------------------------------------------------------------------
# One row (max_batch = 1), prefill free: a request's service is its output_tokens − 1 decode steps of
# STEP seconds (its first token comes with its free prefill), so the replica is an M/G/1 queue and the
# mean wait before admission is Pollaczek–Khinchine's λ·E[S²] / (2(1 − λ·E[S])). Tolerance: 5 %.
STEP = 0.005


def mg1_wait(rate: float, mean_s: float, second_moment_s: float) -> float:
    return rate * second_moment_s / (2 * (1 - rate * mean_s))


def queue_records(rate: float, outputs: np.ndarray, seed: int) -> list[SimRecord]:
    arrivals = poisson_arrivals(rate, len(outputs), seed=seed)
    requests = [
        SimRequest(id=i, prompt_tokens=1, output_tokens=int(n), arrival_s=float(t))
        for i, (n, t) in enumerate(zip(outputs, arrivals, strict=True))
    ]
    model = Linear(prefill_per_token=0.0, decode_fixed=STEP)
    return simulate_open(requests, one(model), ROUTE_ONE, LoopLimits(max_batch=1))


def test_mm1_mean_wait_matches_pollaczek_khinchine():
    # output − 1 ~ geometric on {0, 1, …} with mean 200: service ≈ exponential with mean 1 s, at λ = 0.5.
    p, rate, n = 1 / 201, 0.5, 100_000
    outputs = np.random.default_rng(1).geometric(p, size=n)
    q = 1 - p
    mean_s, second_s = STEP * q / p, STEP**2 * q * (1 + q) / p**2  # exact moments of STEP·Geometric
    expected = mg1_wait(rate, mean_s, second_s)
    assert expected == pytest.approx(rate / (1 / mean_s * (1 / mean_s - rate)), rel=0.01)  # ≈ M/M/1's λ/(μ(μ−λ))
    waits = np.array([rec.wait_s for rec in queue_records(rate, outputs, seed=2)])
    assert waits.mean() == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize(("rho", "n"), [(0.5, 50_000), (0.8, 100_000)])
def test_md1_mean_wait_matches_closed_form(rho, n):
    service = 1.0  # 200 decode steps of 5 ms
    outputs = np.full(n, 201)
    waits = np.array([rec.wait_s for rec in queue_records(rho / service, outputs, seed=3)])
    expected = rho * service / (2 * (1 - rho))  # ρ / (2μ(1 − ρ))
    assert waits.mean() == pytest.approx(expected, rel=0.05)


def test_runs_of_identical_steps_are_one_event(monkeypatch):
    # 200 decode steps per request, yet a handful of events each: the loop jumps, it does not step.
    events = 0
    original = simulation._Simulation._event

    def counting(self, rep):
        nonlocal events
        events += 1
        return original(self, rep)

    monkeypatch.setattr(simulation._Simulation, "_event", counting)
    records = queue_records(0.8, np.full(2_000, 201), seed=4)
    assert all(rec.finished_s - rec.admitted_s == pytest.approx(200 * STEP) for rec in records)
    assert events <= 2 * len(records)  # its prefill step, then one run of 200 decode steps


# -- hand-computed timelines -------------------------------------------------------------------------
def test_closed_loop_at_concurrency_one_is_back_to_back_service():
    model = Linear(prefill_fixed=0.02, prefill_per_token=1e-4, decode_fixed=0.01)
    rng = np.random.default_rng(5)
    requests = [
        SimRequest(id=i, prompt_tokens=int(p), output_tokens=int(o))
        for i, (p, o) in enumerate(zip(rng.integers(1, 257, 200), rng.integers(1, 50, 200), strict=True))
    ]
    requests.append(SimRequest(id=200, prompt_tokens=600, output_tokens=5))  # 3 chunks: 256 + 256 + 88
    records = simulate_closed(requests, 1, one(model), ROUTE_ONE)
    service = []
    for rec in records:
        chunks = math.ceil(rec.request.prompt_tokens / 256)
        prefill = chunks * 0.02 + rec.request.prompt_tokens * 1e-4  # one step per chunk, each with its fixed cost
        assert rec.ttft_s == pytest.approx(prefill, abs=1e-12)
        assert rec.e2e_s == pytest.approx(prefill + (rec.request.output_tokens - 1) * 0.01, abs=1e-12)
        assert rec.wait_s == 0.0
        service.append(rec.e2e_s)
    for before, after in itertools.pairwise(records):
        assert after.arrival_s == before.finished_s  # zero think time
    assert len(records) / records[-1].finished_s == pytest.approx(1 / np.mean(service), rel=1e-12)


def test_a_shared_prefix_is_prefilled_once_per_replica():
    model = Linear(prefill_fixed=0.02, prefill_per_token=1e-4, decode_fixed=0.01)
    requests = [SimRequest(id=i, prompt_tokens=200, output_tokens=3, shared_prefix=150) for i in range(4)]
    records = simulate_closed(requests, 1, one(model), ROUTE_ONE)
    first, *rest = (rec.ttft_s for rec in records)
    assert first == pytest.approx(0.02 + 200 * 1e-4)
    # later ones feed 200 - 144 tokens: 9 full blocks of the 150 shared ones are cached
    assert rest == pytest.approx([0.02 + 56 * 1e-4] * 3)
    assert (
        SimRequest(id=0, prompt_tokens=32, output_tokens=1, shared_prefix=40).to_prefill(True) == 16
    )  # never the last block


HAND = [
    SimRequest(id=0, prompt_tokens=10, output_tokens=2),
    SimRequest(id=1, prompt_tokens=10, output_tokens=4),
    SimRequest(id=2, prompt_tokens=20, output_tokens=2),
    SimRequest(id=3, prompt_tokens=10, output_tokens=1),
]


def test_closed_loop_at_concurrency_two_matches_hand_computation():
    # prefill 1 ms/token; a decode pass 10 ms + 2 ms per row.
    # t=0     r0, r1 prefill 20 tokens -> 0.020 (first tokens)
    # 0.020   decode r0, r1: 0.014 -> 0.034, r0 has its 2 tokens: done, its client sends r2
    # 0.034   decode r1 (12 ms) + prefill r2 (20 ms) -> 0.066: r2's first token
    # 0.066   decode r1, r2: 0.014 -> 0.080: both done, r3 sent
    # 0.080   prefill r3 -> 0.090: its only token
    model = Linear(decode_per_row=0.002)
    rec = by_id(simulate_closed(HAND, 2, one(model), ROUTE_ONE))
    expected = {0: (0, 0.020, 0.034), 1: (0, 0.020, 0.080), 2: (0.034, 0.066, 0.080), 3: (0.080, 0.090, 0.090)}
    for i, (arrival, first, finished) in expected.items():
        assert (rec[i].arrival_s, rec[i].first_token_s, rec[i].finished_s) == pytest.approx((arrival, first, finished))
        assert rec[i].admitted_s == rec[i].arrival_s
    assert rec[1].tpot_s == pytest.approx((0.080 - 0.020) / 3)
    assert rec[3].tpot_s is None
    assert model.prefills == [(20, 0), (20, 1), (10, 0)]


def test_mirror_scheduler_decodes_a_finished_prompt_in_the_same_step():
    # As backends/scheduler.py: the first token comes right after the prefill pass and the row joins
    # that step's decode pass.
    # t=0     prefill r0, r1 (0.020: first tokens) + decode both (0.014) -> 0.034: r0 done, r2 sent
    # 0.034   prefill r2 (-> 0.054: first token) + decode r1, r2 (0.014) -> 0.068: r2 done, r3 sent
    # 0.068   prefill r3 (-> 0.078: its only token, done) + decode r1 (0.012) -> 0.090: r1 done
    model = Linear(decode_per_row=0.002)
    rec = by_id(simulate_closed(HAND, 2, one(model), ROUTE_ONE, LoopLimits(mirror_scheduler=True)))
    expected = {0: (0, 0.020, 0.034), 1: (0, 0.020, 0.090), 2: (0.034, 0.054, 0.068), 3: (0.068, 0.078, 0.078)}
    for i, (arrival, first, finished) in expected.items():
        assert (rec[i].arrival_s, rec[i].first_token_s, rec[i].finished_s) == pytest.approx((arrival, first, finished))


def test_a_long_prompt_is_chunked_while_a_running_row_keeps_decoding():
    # r0 decodes; r1 (600 tokens, chunks of 256) arrives during r0's prefill. Steps: 0.010 (r0's
    # prefill), then 256 + 256 + 88 prompt tokens, each step also decoding r0 (10 ms): r0's tokens
    # 2, 3, 4 come at 0.276, 0.542 and 0.640, when r1 samples its first token.
    model = Linear()
    requests = [
        SimRequest(id=0, prompt_tokens=10, output_tokens=4, arrival_s=0.0),
        SimRequest(id=1, prompt_tokens=600, output_tokens=3, arrival_s=0.005),
    ]
    rec = by_id(simulate_open(requests, one(model), ROUTE_ONE))
    assert model.prefills == [(10, 0), (256, 1), (256, 1), (88, 1)]
    assert rec[0].finished_s == pytest.approx(0.640)
    assert (rec[1].admitted_s, rec[1].first_token_s, rec[1].finished_s) == pytest.approx((0.010, 0.640, 0.660))


@pytest.mark.parametrize(("max_step_tokens", "budget"), [(20, 16), (40, 30)])
def test_prefill_budget_is_what_decoding_leaves_but_never_below_the_floor(max_step_tokens, budget):
    # Ten 1-token prompts decode; a 100-token prompt then gets max(max_step_tokens − 10, 16) per step.
    requests = [SimRequest(id=i, prompt_tokens=1, output_tokens=1000, arrival_s=0.0) for i in range(10)]
    requests.append(SimRequest(id=10, prompt_tokens=100, output_tokens=2, arrival_s=0.001))
    model = Linear()
    simulate_open(requests, one(model), ROUTE_ONE, LoopLimits(max_step_tokens=max_step_tokens))
    full, rest = divmod(100, budget)
    assert model.prefills == [(10, 0)] + [(budget, 10)] * full + [(rest, 10)]


@pytest.mark.parametrize(("mirror", "first_step"), [(False, [256, 44]), (True, [256])])
def test_chunks_fill_the_budget_oldest_first(mirror, first_step):
    # Budget 300: by default the 600-token prompt takes a full chunk and the next one the remaining 44;
    # the scheduler's single chunk width (256) fits only one prompt in the pass.
    requests = [SimRequest(id=i, prompt_tokens=p, output_tokens=1, arrival_s=0.0) for i, p in enumerate([600, 100])]
    model = Linear()
    simulate_open(requests, one(model), ROUTE_ONE, LoopLimits(max_step_tokens=300, mirror_scheduler=mirror))
    assert model.prefills[0] == (sum(first_step), 0)
    assert sum(tokens for tokens, _ in model.prefills) == 700


def test_a_full_replica_admits_the_next_request_when_a_row_frees():
    requests = [SimRequest(id=i, prompt_tokens=10, output_tokens=o, arrival_s=0.0) for i, o in enumerate([2, 5, 3])]
    rec = by_id(simulate_open(requests, one(Linear()), ROUTE_ONE, LoopLimits(max_batch=2)))
    assert rec[0].admitted_s == rec[1].admitted_s == 0.0
    assert rec[0].finished_s == pytest.approx(0.030)  # prefill 0.020, one decode step
    assert rec[2].admitted_s == rec[0].finished_s
    assert rec[2].first_token_s == pytest.approx(0.030 + 0.010 + 0.010)  # decode r1 + prefill r2


# -- routing and input order -------------------------------------------------------------------------
def test_router_sees_the_in_flight_counts():
    seen: list[dict[str, int]] = []
    names = ["a", "b"]

    def alternate(request: SimRequest, in_flight: Mapping[str, int]) -> str:
        seen.append(dict(in_flight))
        return names[request.id % 2]

    rng = np.random.default_rng(6)
    requests = with_arrivals(
        [
            SimRequest(id=i, prompt_tokens=int(p), output_tokens=int(o))
            for i, (p, o) in enumerate(rng.integers(1, 60, (300, 2)))
        ],
        poisson_arrivals(40.0, 300, seed=7),
    )
    records = simulate_open(
        requests, {"a": Linear(), "b": Linear(decode_fixed=0.02)}, alternate, LoopLimits(max_batch=3)
    )
    for k, rec in enumerate(records):
        expected = {
            name: sum(1 for r in records[:k] if r.backend == name and r.finished_s > rec.arrival_s) for name in names
        }
        assert seen[k] == expected
    assert max(max(s.values()) for s in seen) > 3  # some waited: the counts include the queue


def test_least_loaded_spreads_replicas_evenly():
    replicas = [f"r{k}" for k in range(4)]
    requests = [SimRequest(id=i, prompt_tokens=50, output_tokens=20) for i in range(400)]
    records = simulate_closed(requests, 8, {name: Linear() for name in replicas}, least_loaded(replicas))
    assert {name: sum(r.backend == name for r in records) for name in replicas} == dict.fromkeys(replicas, 100)


def test_records_come_back_in_input_order():
    arrivals = np.random.default_rng(8).permutation(50) * 0.01
    requests = [
        SimRequest(id=100 - i, prompt_tokens=5, output_tokens=3, arrival_s=float(t)) for i, t in enumerate(arrivals)
    ]
    records = simulate_open(requests, one(Linear()), ROUTE_ONE)
    assert [rec.request for rec in records] == requests
    assert [rec.arrival_s for rec in records] == [r.arrival_s for r in requests]


# -- an independent step-by-step reference -----------------------------------------------------------
@dataclass
class _Row:
    i: int
    rest: int
    emitted: float = 0.0


def reference(requests, backends, route, limits, concurrency=None):
    """One step at a time, no skipping: a step's whole outcome is fixed when it starts (arrivals during
    it change nothing), so its finish times are known then, and the router's in-flight count at t is
    the requests routed to a replica that have not finished by t."""
    n, order = len(requests), itertools.count()
    arrival, admitted, first, finished, backend = ([None] * n for _ in range(5))
    if concurrency is None:
        pending = [(r.arrival_s, next(order), i) for i, r in enumerate(requests)]
    else:
        pending = [(0.0, next(order), None) for _ in range(min(concurrency, n))]
    heapq.heapify(pending)
    sent = 0
    state = {name: {"waiting": deque(), "prefilling": [], "decoding": [], "next": 0.0} for name in backends}

    def step(name: str, t: float) -> None:
        st, lim, model = state[name], limits[name], backends[name]
        while st["waiting"] and len(st["prefilling"]) + len(st["decoding"]) < lim.max_batch:
            i = st["waiting"].popleft()
            st["prefilling"].append(_Row(i, requests[i].prompt_tokens))
            admitted[i] = t
        d, prefill_s, completed = len(st["decoding"]), 0.0, []
        if st["prefilling"]:
            budget = max(lim.max_step_tokens - d, lim.min_prefill_tokens)
            rows = st["prefilling"]
            if lim.mirror_scheduler:
                width = min(lim.prefill_chunk, max(r.rest for r in rows), budget)
                takes = [min(width, r.rest) if k < max(1, budget // width) else 0 for k, r in enumerate(rows)]
            else:
                takes, left = [], budget
                for r in rows:
                    takes.append(min(lim.prefill_chunk, r.rest, left))
                    left -= takes[-1]
            for r, take in zip(rows, takes, strict=True):
                r.rest -= take
            completed = [r for r in rows if r.rest == 0]
            st["prefilling"] = [r for r in rows if r.rest > 0]
            prefill_s = model.prefill_seconds(sum(takes), d)
            if lim.mirror_scheduler:
                for r in completed:
                    if requests[r.i].output_tokens > 1:
                        r.emitted = 1.0
                        st["decoding"].append(r)
        decoders = list(st["decoding"])
        decode_s, gains = model.decode_step([requests[r.i] for r in decoders]) if decoders else (0.0, [])
        end = t + (decode_s + prefill_s)
        at = t + prefill_s if lim.mirror_scheduler else end
        ends = []
        for r in completed:
            first[r.i] = at
            if requests[r.i].output_tokens == 1:
                finished[r.i] = at
                ends.append(at)
            elif not lim.mirror_scheduler:
                r.emitted = 1.0
                st["decoding"].append(r)
        for r, g in zip(decoders, gains, strict=True):
            r.emitted += g
            if r.emitted >= requests[r.i].output_tokens - 1e-9:
                finished[r.i] = end
                ends.append(end)
        st["decoding"] = [r for r in st["decoding"] if finished[r.i] is None]
        st["next"] = end
        if concurrency is not None:
            for f in ends:
                heapq.heappush(pending, (f, next(order), None))

    while True:
        busy = [(st["next"], k, name) for k, (name, st) in enumerate(state.items()) if has_work(st)]
        tb, _, name = min(busy) if busy else (math.inf, 0, "")
        ta = pending[0][0] if pending else math.inf
        if ta == tb == math.inf:
            break
        if ta <= tb:
            _, _, i = heapq.heappop(pending)
            if i is None:
                if sent == n:
                    continue
                i, sent = sent, sent + 1
            counts = {
                b: sum(1 for j in range(n) if backend[j] == b and (finished[j] is None or finished[j] > ta))
                for b in backends
            }
            target = route(requests[i], counts)
            arrival[i], backend[i] = ta, target
            st = state[target]
            if not has_work(st):
                st["next"] = max(st["next"], ta)
            st["waiting"].append(i)
        else:
            step(name, tb)
    return list(zip(backend, arrival, admitted, first, finished, strict=True))


def has_work(st: dict) -> bool:
    return bool(st["waiting"] or st["prefilling"] or st["decoding"])


def random_case(seed: int, n: int) -> tuple[list[SimRequest], dict[str, Linear], dict[str, LoopLimits]]:
    rng = np.random.default_rng(seed)
    requests = [
        SimRequest(
            id=i,
            prompt_tokens=int(rng.integers(1, 150)),
            output_tokens=int(rng.integers(1, 40)),
            alpha=float(rng.uniform(0.2, 0.9)) if rng.random() < 0.5 else None,  # fractional tokens per step
        )
        for i in range(n)
    ]
    requests = with_arrivals(requests, poisson_arrivals(25.0, n, seed=seed))
    # Costs with no common grain: with round numbers, a finish on one replica can fall exactly on
    # another's step boundary, and which side of it a float sum lands on is a coin toss.
    spec, plain, quant = rng.uniform(0.7, 1.3, size=(3, 5)) * [0.002, 1e-4, 1e-3, 0.012, 0.003]
    backends = {
        "spec": Linear(*spec, gain=1.7, drafting=0.004 * rng.uniform(0.7, 1.3)),
        "plain": Linear(*plain),
        "quant": Linear(*quant),
    }
    limits = {
        "spec": LoopLimits(max_batch=3, max_step_tokens=64, prefill_chunk=32),
        "plain": LoopLimits(max_batch=4, max_step_tokens=100, prefill_chunk=48, min_prefill_tokens=20),
        "quant": LoopLimits(max_batch=2, max_step_tokens=40, prefill_chunk=64),
    }
    return requests, backends, limits


def as_tuples(records: Sequence[SimRecord]) -> list[tuple]:
    return [(r.backend, r.arrival_s, r.admitted_s, r.first_token_s, r.finished_s) for r in records]


def assert_same(got: list[tuple], want: list[tuple]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g[0] == w[0]
        assert g[1:] == pytest.approx(w[1:], abs=1e-9, rel=0)


def by_request_id(request: SimRequest, in_flight: Mapping[str, int]) -> str:
    """Ignores the load, so requests often land on a replica in the middle of a run of decode steps."""
    return ["spec", "plain", "quant"][request.id % 3]


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("concurrency", [None, 6])
@pytest.mark.parametrize(
    "route", [least_loaded(["spec", "plain", "quant"]), by_request_id], ids=["least_loaded", "by_id"]
)
def test_event_skipping_equals_stepping_one_step_at_a_time(mirror, concurrency, route):
    requests, backends, limits = random_case(seed=9, n=300)
    limits = {name: replace(lim, mirror_scheduler=mirror) for name, lim in limits.items()}
    want = reference(requests, backends, route, limits, concurrency)
    if concurrency is None:
        got = simulate_open(requests, backends, route, limits)
    else:
        got = simulate_closed(requests, concurrency, backends, route, limits)
    assert_same(as_tuples(got), want)
    assert len({r.backend for r in got}) == 3


# -- input validation --------------------------------------------------------------------------------
def test_an_unknown_backend_from_the_router_is_named():
    requests = [SimRequest(id=0, prompt_tokens=1, output_tokens=1, arrival_s=0.0)]
    with pytest.raises(ValueError, match="'nowhere'"):
        simulate_open(requests, one(Linear()), lambda request, in_flight: "nowhere")


@pytest.mark.parametrize("arrival", [None, -1.0, math.nan])
def test_open_loop_needs_arrival_times(arrival):
    requests = [SimRequest(id=7, prompt_tokens=1, output_tokens=1, arrival_s=arrival)]
    with pytest.raises(ValueError, match="request 7"):
        simulate_open(requests, one(Linear()), ROUTE_ONE)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        SimRequest(id=0, prompt_tokens=0, output_tokens=1)
    with pytest.raises(ValueError):
        LoopLimits(max_step_tokens=8)  # below the prefill floor
    with pytest.raises(ValueError, match="concurrency"):
        simulate_closed([], 0, one(Linear()), ROUTE_ONE)
    with pytest.raises(ValueError, match="'only'"):
        simulate_closed([], 1, one(Linear()), ROUTE_ONE, {"other": LoopLimits()})
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 10)
