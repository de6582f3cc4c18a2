"""A discrete-event simulation of step-loop backends behind a router, for capacity planning: what N
replicas or ten times the load would do, from a measured profile, without a GPU. Pure Python + numpy.

Each backend replica is modelled as the iteration-level loop of `backends.scheduler`:

- a FCFS waiting queue; at the start of a step, waiting requests get a row while fewer than
  `max_batch` rows are prefilling or decoding;
- the step's token budget is max(max_step_tokens − decoding rows, min_prefill_tokens); prompts still
  prefilling get chunks of at most `prefill_chunk` tokens each, oldest first, within that budget;
- one decode pass runs over the rows that were fully prefilled before this step;
- a step lasts decode seconds (if any row decodes) + prefill seconds (if any chunk went in); at its
  end every decoding row adds its expected tokens, a row whose last chunk went in samples its first
  token, and a row whose tokens reach `output_tokens` finishes and frees its row.

`LoopLimits(mirror_scheduler=True)` follows what `backends/scheduler.py` does where it differs from
that description: a prompt whose last chunk went in samples its first token right after the prefill
pass (step start + prefill seconds) and joins the same step's decode pass, and one pass's chunks
share a single width (min(prefill_chunk, longest rest, budget)), the oldest budget // width
prompts getting one each.

Modelling assumptions a caller must know:
- replicas are independent loops on one shared clock: no contention between them (host CPU, PCIe,
  a shared GPU), so N replicas of one backend are N times one replica's capacity;
- only `max_batch` limits admission: the KV cache never makes a request wait, and cancellations,
  failures and the `max_queued` 429s are not modelled;
- tokens are fluid: a decoding row adds the *expected* tokens of its pass each step (fractional
  for speculation), so speculation's step-to-step variance is not modelled;
- a request's arrival at the very instant a step ends is admitted by the next step, and requests
  that finish at that instant are out of the router's in-flight count by then.

Speed: while a replica's composition is unchanged (nothing prefilling, nobody waiting who could get a
row) its steps are identical, so one event stands for all of them up to the first finish; a request
routed to such a replica while it has a free row cuts the run at the first step boundary after its
arrival. A 10^5-request M/M/1 run takes about two seconds on one core.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Protocol

import numpy as np

from .prefix import BLOCK_TOKENS

# A fluid row counts as done when its expected tokens are within this of its output: float sums of
# fractional tokens (0.1 ten times) must not cost a whole extra step.
_TOKEN_EPS = 1e-9


@dataclass(frozen=True)
class SimRequest:
    """One request as the simulator sees it: its sizes are decided beforehand (EOS/max_tokens)."""

    id: int
    prompt_tokens: int
    output_tokens: int
    category: str | None = None
    arrival_s: float | None = None  # open loop: when it arrives; closed loop: ignored
    alpha: float | None = None  # per-request acceptance, for speculative backend models
    proposal_rate: float | None = None
    shared_prefix: int = 0  # leading prompt tokens every request repeats: cached once a replica prefilled them

    def to_prefill(self, warm: bool) -> int:
        """Prompt tokens a replica feeds for it: on a `warm` replica its shared prefix's full KV
        blocks are cached (never the prompt's last token, which is always fed)."""
        if not warm:
            return self.prompt_tokens
        cached = min(self.shared_prefix, self.prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        return self.prompt_tokens - cached

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"request {self.id}: prompt_tokens and output_tokens must be >= 1")


class BackendModel(Protocol):
    """What one backend replica's passes cost: the caller builds these from a measured profile."""

    def prefill_seconds(self, tokens: int, running: int) -> float:
        """Seconds a step spends feeding `tokens` prompt tokens (all its chunks together) while
        `running` rows decode in that step."""
        ...

    def decode_step(self, rows: Sequence[SimRequest]) -> tuple[float, list[float]]:
        """One decode pass over these rows: its seconds and the expected tokens each row emits.
        Must be a pure function of the rows: the simulator reuses it while the batch is unchanged."""
        ...


@dataclass(frozen=True)
class LoopLimits:
    """How one replica's loop schedules (the `LoopSettings` fields the simulation needs)."""

    max_batch: int = 32
    max_step_tokens: int = 512
    prefill_chunk: int = 256
    min_prefill_tokens: int = 16  # backends/scheduler.py MIN_PREFILL_TOKENS
    mirror_scheduler: bool = False  # True: first token after the prefill pass, same-step decode, one chunk width

    def __post_init__(self) -> None:
        if min(self.max_batch, self.prefill_chunk, self.min_prefill_tokens) < 1:
            raise ValueError("max_batch, prefill_chunk and min_prefill_tokens must be >= 1")
        if self.max_step_tokens < self.min_prefill_tokens:
            raise ValueError("max_step_tokens must be >= min_prefill_tokens")


@dataclass(frozen=True)
class SimRecord:
    """What happened to one request (times in seconds on the simulation clock)."""

    request: SimRequest
    backend: str
    arrival_s: float
    admitted_s: float  # start of the step in which it got a row
    first_token_s: float  # when its first token was sampled (see LoopLimits.mirror_scheduler)
    finished_s: float

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def wait_s(self) -> float:
        return self.admitted_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = self.request.output_tokens
        return None if n == 1 else (self.finished_s - self.first_token_s) / (n - 1)


Router = Callable[[SimRequest, Mapping[str, int]], str]


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` requests/s: cumulative exponential gaps."""
    if not (math.isfinite(rate) and rate > 0) or n < 0:
        raise ValueError(f"need rate > 0 and n >= 0 (got rate={rate}, n={n})")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, size=n))


def with_arrivals(requests: Sequence[SimRequest], arrivals: Sequence[float]) -> list[SimRequest]:
    """The requests with these arrival times, for `simulate_open`."""
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    return [replace(r, arrival_s=float(t)) for r, t in zip(requests, arrivals, strict=True)]


def least_loaded(backends: Sequence[str]) -> Router:
    """A router sending each request to the backend with the fewest in flight (ties: the first)."""
    names = list(backends)
    if not names:
        raise ValueError("least_loaded needs at least one backend")

    def route(request: SimRequest, in_flight: Mapping[str, int]) -> str:
        return min(names, key=in_flight.__getitem__)  # min keeps the first of equals

    return route


def simulate_open(
    requests: Sequence[SimRequest],
    backends: Mapping[str, BackendModel],
    route: Router,
    limits: LoopLimits | Mapping[str, LoopLimits] = LoopLimits(),
) -> list[SimRecord]:
    """Open loop: each request arrives at its `arrival_s` whatever the backends are doing.
    Records come back in input order, one per request."""
    times = [_open_arrival(r) for r in requests]
    order = sorted(range(len(requests)), key=lambda i: (times[i], i))  # simultaneous ones in input order
    arrivals = deque((times[i], i) for i in order)
    return _Simulation(requests, backends, route, limits, arrivals, closed=False).run()


def simulate_closed(
    requests: Sequence[SimRequest],
    concurrency: int,
    backends: Mapping[str, BackendModel],
    route: Router,
    limits: LoopLimits | Mapping[str, LoopLimits] = LoopLimits(),
) -> list[SimRecord]:
    """Closed loop: `concurrency` clients start at t = 0, and each sends the next request of the
    sequence the moment its previous one finishes (zero think time). A record's arrival is when it
    was sent. Records come back in input order, one per request."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 (got {concurrency})")
    arrivals = deque((0.0, i) for i in range(min(concurrency, len(requests))))
    return _Simulation(requests, backends, route, limits, arrivals, closed=True).run()


def _open_arrival(request: SimRequest) -> float:
    t = request.arrival_s
    if t is None or not math.isfinite(t) or t < 0:
        raise ValueError(f"request {request.id}: open loop needs a finite arrival_s >= 0 (got {t})")
    return float(t)


def _chunks(rests: Sequence[int], budget: int, limits: LoopLimits) -> list[int]:
    """Prompt tokens each prefilling row (oldest first, `rests` still to feed) gets this step."""
    if limits.mirror_scheduler:  # backends/scheduler.py `_prefill`: one width for the whole pass
        width = min(limits.prefill_chunk, max(rests), budget)
        chosen = max(1, budget // width)
        return [min(width, rest) if k < chosen else 0 for k, rest in enumerate(rests)]
    takes, left = [], budget
    for rest in rests:
        take = min(limits.prefill_chunk, rest, left)
        takes.append(take)
        left -= take
    return takes


def _steps_to_finish(left: float, gain: float) -> int:
    """Whole steps of `gain` tokens each until `left` more tokens are out (at least the current one)."""
    return max(1, math.ceil((left - _TOKEN_EPS) / gain))


def _checked_seconds(value: float, what: str) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} returned {value} seconds: must be finite and >= 0")
    return value


class _Replica:
    """One backend replica's loop state, and the step (or run of identical steps) in flight."""

    def __init__(self, name: str, order: int, model: BackendModel, limits: LoopLimits) -> None:
        self.name, self.order, self.model, self.limits = name, order, model, limits
        self.waiting: deque[int] = deque()
        self.prefilling: list[list[int]] = []  # [request index, prompt tokens still to feed], oldest first
        self.decoding: list[int] = []
        self.emitted: dict[int, float] = {}
        self.busy = self.ready = self.mid_pending = False
        self.version = 0  # bumped whenever its pending event changes, so stale heap entries are skipped
        self.start = self.end = self.step_s = self.first_token_at = 0.0
        self.steps = 0
        self.decoders: tuple[int, ...] = ()
        self.gains: tuple[float, ...] = ()
        self.row_steps: list[int] = []
        self.completed: list[int] = []  # rows whose last prompt chunk went in this step
        self.warm = False  # a shared prefix's blocks are in its prefix cache (a prompt finished prefill here)
        self.cache_key: tuple[int, ...] | None = None
        self.cache_value: tuple[float, tuple[float, ...]] = (0.0, ())

    def rows(self) -> int:
        return len(self.prefilling) + len(self.decoding)


class _Simulation:
    """The shared clock: arrivals and the replicas' step events, processed in time order."""

    def __init__(
        self,
        requests: Sequence[SimRequest],
        backends: Mapping[str, BackendModel],
        route: Router,
        limits: LoopLimits | Mapping[str, LoopLimits],
        arrivals: deque[tuple[float, int]],
        closed: bool,
    ) -> None:
        if not backends:
            raise ValueError("need at least one backend")
        if not isinstance(limits, LoopLimits):
            missing = [name for name in backends if name not in limits]
            if missing:
                raise ValueError(f"no LoopLimits for backend(s) {', '.join(map(repr, missing))}")
        self.requests, self.route, self.arrivals, self.closed = requests, route, arrivals, closed
        self.replicas = [
            _Replica(name, k, model, limits if isinstance(limits, LoopLimits) else limits[name])
            for k, (name, model) in enumerate(backends.items())
        ]
        self.by_name = {rep.name: rep for rep in self.replicas}
        self.counts = dict.fromkeys(self.by_name, 0)
        self.view = MappingProxyType(self.counts)  # the router reads the counts, never edits them
        self.next_sent = len(arrivals)  # closed loop: the next request of the sequence a client sends
        n = len(requests)
        self.arrival, self.admitted, self.first, self.finished = ([math.nan] * n for _ in range(4))
        self.backend_of = [""] * n
        self.heap: list[tuple[float, int, int]] = []  # (time, replica order, replica version)
        self.clock = 0.0

    def run(self) -> list[SimRecord]:
        ready: list[_Replica] = []  # idle replicas that may start a step once everything at `clock` is in
        while True:
            te = self._peek_event()
            ta = self.arrivals[0][0] if self.arrivals else math.inf
            tn = min(te, ta)
            if ready and tn > self.clock:
                for rep in ready:
                    self._start(rep)
                ready.clear()
                continue
            if tn == math.inf:
                break
            self.clock = tn
            if te <= ta:  # step ends first: finished rows are out before a simultaneous arrival is routed
                rep = self.replicas[heapq.heappop(self.heap)[1]]
                if self._event(rep):
                    rep.ready = True
                    ready.append(rep)
            else:
                rep = self._arrive(self.arrivals.popleft()[1])
                if not rep.busy and not rep.ready:
                    rep.ready = True
                    ready.append(rep)
        return self._records()

    def _peek_event(self) -> float:
        heap = self.heap
        while heap:
            t, order, version = heap[0]
            if self.replicas[order].version == version:
                return t
            heapq.heappop(heap)
        return math.inf

    def _push(self, rep: _Replica, t: float) -> None:
        rep.version += 1
        heapq.heappush(self.heap, (t, rep.order, rep.version))

    def _arrive(self, i: int) -> _Replica:
        request = self.requests[i]
        name = self.route(request, self.view)
        try:
            rep = self.by_name.get(name)
        except TypeError:  # an unhashable answer
            rep = None
        if rep is None:
            known = ", ".join(map(repr, self.by_name))
            raise ValueError(f"router sent request {request.id} to unknown backend {name!r} (known: {known})")
        self.arrival[i], self.backend_of[i] = self.clock, rep.name
        self.counts[rep.name] += 1
        rep.waiting.append(i)
        if rep.busy and rep.steps > 1 and rep.rows() < rep.limits.max_batch:
            self._cut(rep)
        return rep

    def _cut(self, rep: _Replica) -> None:
        """End a run of identical steps at the first boundary at or after now: the new request is
        admitted there (a full replica is never cut: nobody could be admitted before a row finishes)."""
        if rep.step_s <= 0:
            return
        t0, s = rep.start, rep.step_s
        m = max(1, math.ceil((self.clock - t0) / s))
        while t0 + m * s < self.clock:  # rounding must not put the boundary before now
            m += 1
        while m > 1 and t0 + (m - 1) * s >= self.clock:
            m -= 1
        if m < rep.steps:
            rep.steps, rep.end = m, t0 + m * s
            self._push(rep, rep.end)

    def _start(self, rep: _Replica) -> None:
        """Plan the replica's next step at `clock` (or a run of identical decode steps)."""
        rep.ready = False
        t, lim, requests = self.clock, rep.limits, self.requests
        while rep.waiting and rep.rows() < lim.max_batch:
            i = rep.waiting.popleft()
            rep.prefilling.append([i, requests[i].to_prefill(rep.warm)])
            self.admitted[i] = t
        if not rep.rows():
            return
        decoding_before = len(rep.decoding)
        prefill_s, rep.completed, fed = 0.0, [], bool(rep.prefilling)
        if fed:
            budget = max(lim.max_step_tokens - decoding_before, lim.min_prefill_tokens)
            takes = _chunks([rest for _, rest in rep.prefilling], budget, lim)
            for entry, take in zip(rep.prefilling, takes, strict=True):
                entry[1] -= take
                if entry[1] == 0:
                    rep.completed.append(entry[0])
            rep.prefilling = [entry for entry in rep.prefilling if entry[1] > 0]
            rep.warm = rep.warm or bool(rep.completed)
            prefill_s = _checked_seconds(rep.model.prefill_seconds(sum(takes), decoding_before), "prefill_seconds")
            if lim.mirror_scheduler:  # a prompt just finished samples its first token and decodes in this step
                for i in rep.completed:
                    if requests[i].output_tokens > 1:
                        rep.decoding.append(i)
                        rep.emitted[i] = 1.0
        rep.decoders = tuple(rep.decoding)
        decode_s, rep.gains = self._decode(rep) if rep.decoders else (0.0, ())
        emitted = rep.emitted
        rep.row_steps = [
            _steps_to_finish(requests[i].output_tokens - emitted[i], g)
            for i, g in zip(rep.decoders, rep.gains, strict=True)
        ]
        # Only a step without prefill repeats itself: the same rows, the same pass, until one finishes.
        rep.steps = 1 if fed else min(rep.row_steps)
        rep.start, rep.step_s = t, decode_s + prefill_s
        rep.end = t + rep.steps * rep.step_s
        rep.first_token_at = t + prefill_s if lim.mirror_scheduler else rep.end
        rep.mid_pending = bool(rep.completed) and rep.first_token_at < rep.end
        rep.busy = True
        self._push(rep, rep.first_token_at if rep.mid_pending else rep.end)

    def _decode(self, rep: _Replica) -> tuple[float, tuple[float, ...]]:
        if rep.decoders != rep.cache_key:
            seconds, gains = rep.model.decode_step([self.requests[i] for i in rep.decoders])
            gains = tuple(float(g) for g in gains)
            if len(gains) != len(rep.decoders) or not all(math.isfinite(g) and g > 0 for g in gains):
                raise ValueError(f"decode_step of {rep.name!r} must return one positive token count per row")
            rep.cache_key, rep.cache_value = rep.decoders, (_checked_seconds(seconds, "decode_step"), gains)
        return rep.cache_value

    def _event(self, rep: _Replica) -> bool:
        """The replica's pending event at `clock`: its first tokens (mirror mode, mid-step) or its step's
        end. True when the step is over and the replica may start the next."""
        if rep.mid_pending:
            rep.mid_pending = False
            self._first_tokens(rep)
            heapq.heappush(self.heap, (rep.end, rep.order, rep.version))
            return False
        self._first_tokens(rep)  # (before the decoders, so simultaneous finishes keep one order)
        done = set()
        for i, g, steps in zip(rep.decoders, rep.gains, rep.row_steps, strict=True):
            rep.emitted[i] += rep.steps * g
            if steps <= rep.steps:
                done.add(i)
        if done:
            rep.decoding = [i for i in rep.decoding if i not in done]
            for i in rep.decoders:
                if i in done:
                    del rep.emitted[i]
                    self._finish(rep, i)
        rep.busy = False
        return True

    def _first_tokens(self, rep: _Replica) -> None:
        for i in rep.completed:
            self.first[i] = self.clock
            if self.requests[i].output_tokens == 1:
                self._finish(rep, i)
            elif not rep.limits.mirror_scheduler:  # it decodes from the next step on
                rep.decoding.append(i)
                rep.emitted[i] = 1.0
        rep.completed = []

    def _finish(self, rep: _Replica, i: int) -> None:
        self.finished[i] = self.clock
        self.counts[rep.name] -= 1
        if self.closed and self.next_sent < len(self.requests):  # its client sends the next request now
            self.arrivals.append((self.clock, self.next_sent))
            self.next_sent += 1

    def _records(self) -> list[SimRecord]:
        return [
            SimRecord(r, self.backend_of[i], self.arrival[i], self.admitted[i], self.first[i], self.finished[i])
            for i, r in enumerate(self.requests)
        ]
