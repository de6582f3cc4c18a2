"""The step loop every backend replica runs: iteration-level scheduling over a paged KV cache,
with speculation inside the same loop.

Every `step`:
1. requests whose client left are dropped, and waiting requests are admitted (first come, first
   served) while fewer than `max_batch` run and the KV cache can promise each its whole context
   (prompt + max_tokens) — a request that does not fit yet waits for room, so a replica never runs
   out of memory mid-run;
2. prompts are prefilled in chunks of at most `prefill_chunk` tokens within the step's token
   budget, after the running rows' share of it, so a long prompt never stalls the running
   streams for its whole prefill; a prompt whose last chunk went in samples its first token;
3. one target pass advances every running sequence: a plain row feeds its newest token, a
   speculative row that token and its drafts. With k = auto, how much each row drafts and then
   verifies is chosen here, for the live batch, by one function (`plan_step`: the measured pass
   times at this batch size, each drafter's cost): before drafting from each row's running α and
   proposal rate (a drafter that costs nothing, prompt lookup, is always asked); while a model
   drafts, after every draft step, from the predicted acceptance of what it drew so far; and once
   drafted, from each drafted position's predicted acceptance (`speculative.acceptance`), so a
   proposal whose expected gain does not pay for the wider pass is cut short or not verified at
   all. Rows for which drafting does not pay ride the same pass as plain rows. A structured
   drafter's row (lookahead) feeds one block holding its Jacobi window and several candidate
   continuations, verified by the multi-candidate rule, the accepted branch's keys kept; with
   k = auto it runs while a pass that wide is expected to emit more tokens per second than a
   1-token pass;
4. tokens go out one at a time through each row's listener as they are produced, and a row that
   finishes (EOS, a stop string, max_tokens) leaves at once and frees its cache blocks.

Exactness does not depend on the batch: a row attends to exactly its own tokens at its own
positions, samples from its own generator, and the accept/resample rule is applied per row, so in
float32 every request's greedy tokens equal decoding it alone with the plain engine, whatever
joined or left meanwhile. A failure inside the loop (a drafter's, a listener's, one pass's) ends
the requests it touched with that error and leaves the others running.

The loop is synchronous and single-threaded (`backends.serving` runs it in a thread of its own);
`generate` runs a fixed set of requests to completion on it, which is what tests, benchmarks and
the profiler use.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.cost_model import RowOutlook, plan_step
from policies.engines import ENGINES, GGUF_WEIGHTS, EngineName, GgufWeights
from policies.prefix import BLOCK_TOKENS
from policies.profile import AcceptanceMap, ContextCurve, CostCurve, Profile
from policies.quantization import REDUCED_PRECISION

from .engines import build_engine
from .errors import RequestError
from .generation import GenerationRequest, GenerationResult, SequenceState, TokenListener, listener_for
from .models import LoadedModel
from .pass_timing import measure_step_times
from .plain import PlainEngine
from .sampling import new_generator, sample_tokens, target_probs
from .speculative.acceptance import AcceptancePredictor, refine_offset
from .speculative.control import DraftCosts, DraftOutlook, RateEstimate, StepCosts, batch_bucket
from .speculative.drafters import Drafter, DraftJudge, DraftRow, Proposal, StructuredDraft
from .speculative.rejection import (
    CandidateVerdict,
    accept_candidates_greedy,
    accept_candidates_sampled,
    accept_greedy,
    accept_sampled,
    candidate_chains,
)
from .speculative.stats import SpeculationStats

log = logging.getLogger("specroute.scheduler")
KSetting = int | Literal["auto"]
K_LIMIT = 32
# What a request names as its drafter to decode without drafting in a loop that drafts (no
# drafter's name: those are kinds with their options).
PLAIN_ROW = "plain"
# Measured on a 2-core AMD EPYC in bfloat16 (docs/benchmarks/history.md): a pass costs more the wider it is, so the
# default tile is the narrowest that verifies the default k_max of 8.
DEFAULT_TILE_WIDTH = 9
# Measured there too (1 thread, 192 cached tokens): a 9-wide tile costs 1.3× a 1-wide pass alone,
# 2.4× at batch 2 and 3.7× at batch 32 (compute-bound), so by default only a lone sequence's passes
# are tiled — what keeps speculative output equal to plain output at batch 1.
DEFAULT_TILE_MAX_ROWS = 1
MIN_PREFILL_TOKENS = 16  # a step always prefills at least this much, however busy decoding is
# A row whose proposals auto k keeps declining still verifies every Nth one (a probe), so the
# acceptance map and the row's offset keep learning: without it, a map refitted on traffic that
# copies nothing (chat) predicted ~0 for every later proposal, and a replica stopped speculating for
# good, also on prompts that copy (seen in `bench model-fit`). N doubles after each rejected probe
# up to PROBE_RARELY, so a row where drafts never pay widens few passes. A probe verifies as much
# of the proposal as a pass of at most PROBE_COST 1-token passes holds: a whole draft where decode
# is memory-bound (each judged position teaches), none where it is compute-bound (verifying rarely
# pays there whatever the map says, and a probe would widen every row's pass).
PROBE_EVERY, PROBE_RARELY, PROBE_COST = 8, 64, 1.3
FailureListener = Callable[[BaseException], None]


class LoopSettings(BaseModel):
    """How one replica's step loop schedules (part of the backends' settings)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineName = Field(
        "torch",
        description=f"what runs the target's passes ({', '.join(ENGINES)}): torch is the exact float reference; "
        "llamacpp serves a .gguf model with llama.cpp's own kernels and weight types",
    )
    gguf_weights: GgufWeights = Field(
        "file",
        description=f"the weights the llamacpp engine serves ({', '.join(GGUF_WEIGHTS)}): the .gguf file's own types, "
        "or the file requantized by llama.cpp to one type (kept under SPECROUTE_HOME); each is its own numerical "
        "model, its quality against the float target measured by `bench plain`",
    )
    max_batch: int = Field(32, ge=1, le=512, description="most sequences running at once")
    max_step_tokens: int = Field(
        512, ge=MIN_PREFILL_TOKENS, le=65536, description="tokens one step feeds: running rows, then prompt chunks"
    )
    prefill_chunk: int = Field(256, ge=1, le=65536, description="most prompt tokens of one request per step")
    max_queued: int = Field(256, ge=0, le=100_000, description="requests waiting for a row before new ones get 429")
    kv_cache_tokens: int | None = Field(
        None, ge=64, description="tokens the KV cache may hold over all sequences (default: max_batch × 2048)"
    )
    width_invariant: Literal["auto", "on", "off"] = Field(
        "auto",
        description="run decode and verify passes tile_width positions wide, so speculative output equals "
        "plain output bit for bit in reduced precision ('auto': on for bfloat16 and float16 targets)",
    )
    tile_max_rows: int | None = Field(
        DEFAULT_TILE_MAX_ROWS,
        ge=1,
        description="width-invariant passes are those of at most this many sequences (null: every pass); larger "
        "batches run at natural widths, where a tile's extra positions cost real compute",
    )
    prefix_caching: bool = Field(
        True,
        description="reuse the KV blocks of prompt prefixes earlier requests computed (a system prompt, a "
        "conversation's history, shared documents): only the rest is prefilled; output is unchanged. Float32 "
        "targets on the torch engine only: bfloat16 and int-quantized passes round keys differently by chunk",
    )
    tile_width: int = Field(
        DEFAULT_TILE_WIDTH,
        ge=2,
        le=K_LIMIT + 1,
        description="positions of a width-invariant pass: every loop over one target must use the same, and a "
        "speculative loop verifies at most tile_width - 1 drafted tokens",
    )

    @model_validator(mode="after")
    def _weights_are_llamacpps(self) -> LoopSettings:
        if self.gguf_weights != "file" and self.engine == "torch":
            raise ValueError(
                f"gguf_weights {self.gguf_weights} requantizes the .gguf file the llamacpp engine serves; the "
                f"{self.engine} engine loads its own weights: set engine llamacpp, or leave gguf_weights at file"
            )
        return self

    @property
    def cache_tokens(self) -> int:
        return self.kv_cache_tokens or self.max_batch * 2048

    def tile(self, dtype: str) -> int | None:
        """The width tiled target passes run at for a target in `dtype`, or None (natural widths);
        which passes are tiled: `tile_max_rows`."""
        if self.engine != "torch":  # tiles make torch's kernels width-invariant; other engines measure their own
            return None
        on = self.width_invariant == "on" or (self.width_invariant == "auto" and dtype in REDUCED_PRECISION)
        return self.tile_width if on else None


@dataclass
class Row:
    """One request in the loop, from waiting to finished."""

    key: int
    state: SequenceState
    draft: DraftRow
    drafter: Drafter | None
    outlook: DraftOutlook | None  # running α and ρ (speculative rows)
    rng: np.random.Generator  # Thompson draws of α for the planner
    on_failure: FailureListener | None
    offset: float = 0.0  # this request's correction to its drafter's acceptance map (logit scale)
    declined: int = 0  # proposals in a row that auto k verified none of
    probe_every: int = PROBE_EVERY  # the declined proposal that is probed anyway (backs off)
    probing: bool = False  # this step verifies a probe
    seq: int = -1  # the target cache's sequence, once admitted
    computed: int = 0  # tokens of `context` already in the cache
    resume: list[int] | None = None  # preempted: the prompt and verified tokens to prefill again
    cancelled: bool = False
    done: bool = False
    error: BaseException | None = field(default=None, repr=False)

    @property
    def context(self) -> list[int]:
        """What the row prefills: its prompt, or after a preemption every token it had in the cache."""
        return self.resume if self.resume is not None else self.state.prompt_ids

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.context)

    @property
    def stats(self) -> SpeculationStats | None:
        return self.state.speculation


@dataclass(frozen=True)
class StepRecord:
    """One step: the sequences it ran (prefilling or decoding) and the tokens it appended."""

    rows: int
    tokens: int


@dataclass
class _Drafting:
    """What each drafter's call took this step, how many context tokens it caught up on, how many
    sequential draft steps it ran (its longest proposal) and for how many rows."""

    seconds: dict[str, float] = field(default_factory=dict)
    backlog: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)


@dataclass
class _Verified:
    accepted: list[int]
    emitted: list[list[int]]
    branches: list[int]  # structured rows: the candidate kept (else 0)


@dataclass
class _Proposed:
    """This step's drafts per row (what will be verified), each drafted position's features and
    predicted acceptance (empty where the drafter reports none), q and what drafting took."""

    drafts: list[list[int]]
    features: list[np.ndarray]
    predicted: list[np.ndarray]
    q: torch.Tensor | None
    drafting: _Drafting
    structured: list[StructuredDraft | None]  # rows whose proposal is a structured block


class Scheduler:
    def __init__(
        self,
        loaded: LoadedModel,
        settings: LoopSettings | None = None,
        drafters: Sequence[Drafter] = (),
        k: KSetting = "auto",
        k_max: int = 8,
        costs: StepCosts | None = None,
        draft_costs: Mapping[str, DraftCosts] | None = None,
        acceptance_maps: Mapping[str, AcceptanceMap] | None = None,
    ):
        """`drafters`: the drafters rows may speculate with (none: a plain loop); the first is the
        default. `k`: a fixed draft length, or "auto" (planned per step up to `k_max`). `costs`
        (the target's step-time table) may be shared by loops serving the same target;
        `draft_costs` (per drafter name, e.g. from a profile) start each drafter's measured cost;
        `acceptance_maps` (per drafter name, e.g. from a profile) its per-proposal predictor."""
        if k != "auto" and not (type(k) is int and 0 <= k <= K_LIMIT):
            raise RequestError(f"k must be an integer from 0 to {K_LIMIT} or 'auto' (got {k!r})")
        if k == "auto" and not 1 <= k_max <= K_LIMIT:
            raise RequestError(f"k_max must be between 1 and {K_LIMIT} (got {k_max})")
        self.settings = settings or LoopSettings()
        self.plain = PlainEngine(loaded)  # prompt encoding, EOS ids and context checks are shared
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.drafters = {d.name: d for d in drafters}
        if len(self.drafters) != len(drafters):  # requests name their drafter: two of one name would be one
            raise ValueError(f"drafter names must differ (got {[d.name for d in drafters]})")
        self.default_drafter = drafters[0].name if drafters else None
        self.k, self.k_max = k, (k_max if k == "auto" else int(k))
        self.tile = self.settings.tile(loaded.info.dtype)
        # The widest pass a step may run: k_max drafts after the newest token, or a structured block.
        self.widest = max([self.k_max + 1, *(d.widest_block for d in drafters)])
        if drafters and self.tile is not None and self.widest > self.tile:
            structured = [d.name for d in drafters if d.widest_block > self.tile]
            needs = f"drafter {structured[0]}" if structured else f"k_max {self.k_max}"
            raise RequestError(
                f"{needs} needs passes of {self.widest} positions; width-invariant passes here are {self.tile} "
                "wide: lower k (or k_max, or the lookahead window), or raise tile_width for every backend of "
                "this target"
            )
        layers = sorted({i for d in drafters for i in d.feature_layers})
        self.cache = build_engine(loaded, self.settings, layers, self.tile)
        for drafter in drafters:
            reason = self.cache.refusal(drafter)
            if reason is not None:
                self.cache.close()  # a llama.cpp context holds its whole KV cache until freed
                raise RequestError(f"the {self.cache.name} engine cannot serve drafter {drafter.name}: {reason}")
        self.costs = costs if costs is not None or not drafters else step_costs(loaded, self.widest, self.settings)
        if self.costs is not None and self.costs.max_width < self.widest:
            raise ValueError(f"the step-cost table covers widths up to {self.costs.max_width}, need {self.widest}")
        seeded = draft_costs or {}
        self.drafter_costs = {name: copy.deepcopy(seeded.get(name, DraftCosts())) for name in self.drafters}
        self.drafter_totals = {name: SpeculationStats(drafter=name, k_mode=str(k)) for name in self.drafters}
        # Each drafter's acceptance across requests: a new request starts from it.
        self.outlooks = {
            name: DraftOutlook(RateEstimate(decay=0.99), RateEstimate(prior_mean=0.9, decay=0.99))
            for name in self.drafters
        }
        maps = acceptance_maps or {}
        self.predictors = {
            name: AcceptancePredictor(name, d.acceptance_features, maps.get(name)) for name, d in self.drafters.items()
        }
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []
        self._next_key = 0
        self.steps = 0
        self.preemptions = 0  # rows preempted for KV blocks since the loop started
        self.last_step = StepRecord(0, 0)

    # -- requests ---------------------------------------------------------------------------
    def close(self) -> None:
        """Free the engine's memory now (a loop that is done: benches, quality measurements)."""
        self.cache.close()

    def check(self, request: GenerationRequest, drafter: str | None = None) -> list[int]:
        """The request's prompt ids, or a `RequestError` saying why this loop cannot serve it."""
        ids = self.plain.encode(request)
        needed = len(ids) + request.max_tokens
        capacity = min(self.settings.cache_tokens, self.cache.sequence_tokens)
        if needed > capacity:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) needs {needed} tokens of KV cache; "
                f"this backend holds {capacity}: shorten the prompt or lower max_tokens"
            )
        self._drafter(drafter)
        return ids

    def submit(
        self,
        request: GenerationRequest,
        listener: TokenListener | None = None,
        drafter: str | None = None,
        on_failure: FailureListener | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Row:
        """Queue a request (its clock starts now); `listener` hears each token as it is appended.
        `prompt_ids`: what `check` returned for this request, so the prompt is not encoded twice."""
        ids = prompt_ids if prompt_ids is not None else self.check(request, drafter)
        chosen = self._drafter(drafter)
        generator, seed = new_generator(request.sampling.seed)
        state = SequenceState(request, ids, self.plain.eos_ids, seed, time.perf_counter(), listener=listener)
        key, self._next_key = self._next_key, self._next_key + 1
        draft = DraftRow(key, state.prompt_ids, state.token_ids, request.sampling, generator)
        outlook = None
        if chosen is not None:
            state.speculation = SpeculationStats(drafter=chosen.name, k_mode=str(self.k))
            # Weight 4: a drafter known to fail rarely tempts a request into a costly first draft.
            outlook = self.outlooks[chosen.name].seeded(weight=4.0)
        row = Row(key, state, draft, chosen, outlook, np.random.default_rng(seed), on_failure)
        self.waiting.append(row)
        return row

    def cancel(self, row: Row) -> None:
        """The client is gone: the row leaves at the next step."""
        row.cancelled = True

    def abort(self, exc: BaseException) -> None:
        """End every request in the loop with `exc` (the loop itself failed)."""
        self._fail_all([*self.running, *self.waiting], exc)
        self.running, self.waiting = [], deque()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        listeners: Sequence[TokenListener | None] | None = None,
        drafters: Sequence[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Run these requests to completion (a static batch when the loop is otherwise idle);
        `listeners[i]` (optional) hears request i's tokens as they come, `drafters[i]` names the
        drafter it speculates with (default: the loop's first)."""
        if self.costs is not None:  # probes run before any request's clock starts
            self.costs.ensure(min(len(requests), self.settings.max_batch))
        rows = [
            self.submit(r, listener_for(listeners, i, len(requests)), drafters[i] if drafters else None)
            for i, r in enumerate(requests)
        ]
        try:
            while not all(r.done for r in rows):
                self.step()
        except Exception as exc:  # a bug in the loop: leave nothing behind for the next call
            self.abort(exc)
            raise
        failed = next((r.error for r in rows if r.error is not None), None)
        if failed is not None:
            raise failed
        return [r.state.result(self.tokenizer) for r in rows]

    def _drafter(self, name: str | None) -> Drafter | None:
        if name == PLAIN_ROW:
            return None
        if name is None:
            return self.drafters.get(self.default_drafter) if self.default_drafter else None
        if name not in self.drafters:
            if not self.drafters:
                raise RequestError(f"this backend does not draft: drop the drafter {name!r}")
            raise RequestError(f"unknown drafter {name!r}: this backend drafts with {', '.join(self.drafters)}")
        return self.drafters[name]

    # -- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        self.steps += 1
        self._drop_cancelled()
        self._make_room()
        self._admit()
        ran, before = list(self.running), sum(len(r.state.token_ids) for r in self.running)
        prefilling = [r for r in self.running if not r.prefilled]
        if prefilling:
            # The running rows' newest tokens come out of the budget first; prompts get the rest.
            decoding = len(self.running) - len(prefilling)
            self._prefill(prefilling, max(self.settings.max_step_tokens - decoding, MIN_PREFILL_TOKENS))
        decoding_rows = [r for r in self.running if r.prefilled and not r.done]
        if decoding_rows:  # a prompt finished just now decodes in this very step
            self._decode(decoding_rows)
        self.running = [r for r in self.running if not r.done]
        # What the step ran, for the metrics: rows that finished in it have already left `running`.
        self.last_step = StepRecord(len(ran), sum(len(r.state.token_ids) for r in ran) - before)

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.running if r.cancelled]:
            self._retire(row)
        self.running = [r for r in self.running if not r.done]
        kept = deque()
        for row in self.waiting:
            if row.cancelled:  # a preempted row's drafter may still hold its state
                self._retire(row)
            else:
                kept.append(row)
        self.waiting = kept

    def _admit(self) -> None:
        """First come, first served, while a row is free and the pool holds the head's context and
        one step of growth — leaving a block of growth to every running row. Memory is promised
        lazily: a row takes more blocks as it grows (`_make_room`), not its `max_tokens` up front."""
        while self.waiting and len(self.running) < self.settings.max_batch:
            row = self.waiting[0]
            state = row.state  # never more than the whole request: one that fills the pool alone still fits
            needed = min(len(row.context) + self.widest, len(state.prompt_ids) + state.request.max_tokens)
            prefix, salt = self._cacheable_prefix(row), row.state.request.cache_salt
            if not self.cache.can_reserve(needed, prefix, salt, growing=len(self.running)):
                break  # the head waits for room, and so does everyone behind it
            self.waiting.popleft()
            row.seq = self.cache.add(needed, prefix, salt)
            row.computed = self.cache.length(row.seq)
            self._count_cached(row)
            self.running.append(row)

    def _make_room(self) -> None:
        """Every row that decodes this step gets a block for its newest token if it needs one: while
        the pool cannot give them all, the most recently admitted row is preempted (vLLM's recompute
        preemption). A lone row always fits: `check` refused any request the pool cannot hold."""
        while len(self.running) > 1:
            need = sum(self.cache.growth_blocks(r.seq, 1) for r in self.running if r.prefilled)
            if need <= self.cache.spare_blocks():
                return
            self._preempt(self.running[-1])

    def _preempt(self, row: Row) -> None:
        """The row leaves the batch and waits at the head of the queue, keeping every token it
        produced: on its return it prefills its prompt and those tokens again (from cached blocks
        where the pool kept them) and decodes on. Its stream pauses; its tokens do not change."""
        self.preemptions += 1
        self.running.remove(row)
        if row.drafter is not None and row.drafter.feature_layers:
            try:  # it will be told the target's features of the whole context again, as it is prefilled
                row.drafter.release(row.key)
            except Exception as exc:  # that drafter's state is lost: this row alone ends
                self._fail(row, exc)
                return
        verified = [*row.state.prompt_ids, *row.state.token_ids]
        self.cache.commit(row.seq, verified)
        self.cache.remove(row.seq)
        row.seq, row.computed = -1, 0
        row.resume = verified[:-1] if row.state.token_ids else None  # the newest token is fed by the next step
        self.waiting.appendleft(row)

    @staticmethod
    def _cacheable_prefix(row: Row) -> list[int]:
        """The prompt to look up in the prefix cache: none for a row whose drafter reads the target's
        hidden states, which a cached block does not keep (it prefills in full and stays consistent)."""
        return [] if row.drafter is not None and row.drafter.feature_layers else row.context

    def _prefill(self, rows: list[Row], budget: int) -> None:
        """One pass over prompt chunks: oldest requests first, one chunk width for the pass. A row
        first takes the cached blocks other rows computed since it joined, and a row whose next block
        an older row computes in this pass waits one step to take it from the cache — requests that
        arrive together with one system prompt compute it once, not once per chunk pair."""
        self._adopt_cached(rows)
        rows = self._distinct(rows)
        longest = max(len(r.context) - r.computed for r in rows)
        width = min(self.settings.prefill_chunk, longest, budget)
        if longest > width > BLOCK_TOKENS:  # a row that goes on stays at a prefix-cache block boundary
            width -= width % BLOCK_TOKENS
        chosen = rows[: max(1, budget // width)]
        blocks = [r.context[r.computed : r.computed + width] for r in chosen]
        ready = [b for b, r in enumerate(chosen) if r.computed + len(blocks[b]) >= len(r.context)]
        # Their prompt's last chunk goes in now: they sample a first token (a resumed row has one).
        ready = [b for b in ready if not chosen[b].state.token_ids]
        done = [chosen[b] for b in ready]
        try:
            logits = self.cache.last_logits([r.seq for r in chosen], blocks)
            params, generators = [r.draft.sampling for r in done], [r.draft.generator for r in done]
            first = sample_tokens(logits[ready], params, generators).tolist() if done else []
        except Exception as exc:  # the pass failed: only the rows in it end
            self._fail_all(chosen, exc)
            return
        for row, block in zip(chosen, blocks, strict=True):
            row.computed += len(block)
            self.cache.commit(row.seq, row.context)  # later requests may start from these blocks
        self._report_features(chosen, [len(b) for b in blocks])
        for row, token in zip(done, first, strict=True):
            self._emit(row, [int(token)])

    def _adopt_cached(self, rows: list[Row]) -> None:
        for row in rows:
            prefix = self._cacheable_prefix(row)
            if prefix and self.cache.adopt(row.seq, prefix):
                row.computed = self.cache.length(row.seq)
                self._count_cached(row)

    def _count_cached(self, row: Row) -> None:
        """The prompt tokens the row took from the prefix cache, for its usage (a resumed row's
        cached context is its own earlier work, not the prompt's)."""
        if row.resume is None:
            row.state.cached_tokens = self.cache.cached_tokens(row.seq)

    def _distinct(self, rows: list[Row]) -> list[Row]:
        """The rows, less any whose next block an older one among them is about to compute."""
        computing: set[bytes] = set()
        kept = []
        for row in rows:
            prefix = self._cacheable_prefix(row)
            key = self.cache.next_key(row.seq, prefix) if prefix else None
            if key is not None and key in computing:
                continue
            if key is not None:
                computing.add(key)
            kept.append(row)
        return kept

    def _decode(self, rows: list[Row]) -> None:
        """One target pass for every running row, with drafts where they pay."""
        ks = self._plan(rows)
        if self._drafts_overflow(rows, ks):  # a plain step is exact too, and `_make_room` kept room for it
            ks = [0] * len(rows)
        proposed = self._propose(rows, ks)
        live = [b for b, r in enumerate(rows) if not r.done]  # a drafter failure ended some rows
        rows, ks = [rows[b] for b in live], [ks[b] for b in live]
        drafts, q, drafting = [proposed.drafts[b] for b in live], proposed.q, proposed.drafting
        structured = [proposed.structured[b] for b in live]
        features, predicted = [proposed.features[b] for b in live], [proposed.predicted[b] for b in live]
        if not rows:
            return
        asked, drawn = list(ks), [len(d) for d in drafts]  # before the verify choice
        first = [float(p[0]) if len(p) else None for p in predicted]
        if self.k == "auto":
            for b, (row, d) in enumerate(zip(rows, drafts, strict=True)):
                if d and row.drafter is not None and not row.drafter.free:
                    ks[b] = len(d)  # where the judge stopped it is this step's choice, not a shortfall
            if any(len(p) for p in predicted):
                self._choose_verified(rows, ks, drafts, predicted, sum(drafting.seconds.values()))
        if q is not None and len(live) < len(q):  # (B, K, V) is large: copy it only when rows left
            q = q[live]
        drafted_at = time.perf_counter()
        blocks = [
            s.tokens if s is not None else [r.state.token_ids[-1], *d]
            for r, d, s in zip(rows, drafts, structured, strict=True)
        ]
        batch, longest = len(rows), max(len(b) for b in blocks)
        before = [self.cache.length(r.seq) for r in rows]
        context = sum(before) / batch
        width = (
            self.costs.cheapest_width(batch, longest, context) if self.costs is not None and longest > 1 else longest
        )
        shapes = [s.structure if s is not None else None for s in structured] if any(structured) else None
        try:
            logits = self.cache.logits([r.seq for r in rows], blocks, width, structures=shapes)
            if logits.is_cuda:  # kernels run asynchronously: wait for them before reading the clock
                torch.cuda.synchronize(logits.device)
            forward_s = time.perf_counter() - drafted_at
            verified = self._verify(rows, drafts, q, logits, structured)
        except Exception as exc:
            self._fail_all(rows, exc)
            return
        for row, start, n, s, branch in zip(
            rows, before, verified.accepted, structured, verified.branches, strict=True
        ):
            if s is None:
                self.cache.truncate(row.seq, start + 1 + n)
            else:  # the root and the accepted branch's tokens stay, moved into place
                self.cache.keep_branch(row.seq, start, [0, *s.branches[branch][:n]] if s.branches else [0])
        if shapes is not None:
            self._observe_blocks(rows, structured, logits)
        self._observe(rows, ks, drafts, verified.accepted, asked)
        self._observe_declined(rows, ks, drawn, first)
        self._learn(rows, drafts, features, predicted, verified.accepted)
        self._report_features(rows, [n + 1 for n in verified.accepted])
        verify_s = time.perf_counter() - drafted_at
        declined = [n - len(d) for n, d in zip(drawn, drafts, strict=True)]
        self._record(
            rows, ks, asked, declined, drafts, verified.accepted, drafting, verify_s, forward_s, width, context
        )
        for row, tokens in zip(rows, verified.emitted, strict=True):
            self._emit(row, tokens)

    def _drafts_overflow(self, rows: list[Row], ks: list[int]) -> bool:
        """Would this step's drafts (at most `widest` tokens a row) need more blocks than the pool spares?"""
        if not any(ks):
            return False
        need = sum(self.cache.growth_blocks(r.seq, self.widest if k else 1) for r, k in zip(rows, ks, strict=True))
        return need > self.cache.spare_blocks()

    # -- speculation ------------------------------------------------------------------------
    def _plan(self, rows: list[Row]) -> list[int]:
        """k per row for this step: fixed, or planned for the whole step from measurements."""
        batch = len(rows)
        caps = [self._k_cap(r, batch) for r in rows]
        if self.k != "auto" or not any(caps):
            return [min(self.k_max, c) for c in caps]
        assert self.costs is not None
        eligible = [r for r, cap in zip(rows, caps, strict=True) if cap]
        if all(r.drafter.free and not r.drafter.widest_block for r in eligible):  # type: ignore[union-attr]
            # Free drafters are asked whatever a plan says (their proposals are judged once drawn):
            # on a fast engine planning every step would cost more than drafting (~3 % of a step here).
            return caps
        pass_s = self._pass_seconds(rows)
        draft_s, catch_up = {}, {}
        for name, drafter in self.drafters.items():
            costs = self.drafter_costs[name]
            drafting = max(1, sum(1 for r in eligible if r.drafter is drafter))  # the rows it would draft for
            draft_s[name] = costs.step_s.get(batch_bucket(drafting), 0.0)
            catch_up[name] = costs.catch_up_s(_backlog(drafter, eligible))
        outlooks = [
            RowOutlook(r.drafter.name, r.outlook.alpha.sample(r.rng), r.outlook.proposal.mean, cap)
            if r.drafter is not None and r.outlook is not None and not r.drafter.free
            else RowOutlook(None, 0.0, 0.0, 0)
            for r, cap in zip(rows, caps, strict=True)
        ]
        planned = plan_step(outlooks, pass_s, draft_s, self.k_max, catch_up)
        # Asking a free drafter costs nothing: its proposal is judged once it exists. A drafter of
        # structured blocks (lookahead) widens the pass whatever it proposes: it plans its own block.
        return [
            k
            if r.drafter is None or not cap
            else r.drafter.plan_block(r.draft, cap, pass_s)
            if r.drafter.widest_block
            else cap
            if r.drafter.free
            else k
            for r, k, cap in zip(rows, planned, caps, strict=True)
        ]

    def _pass_seconds(self, rows: list[Row]) -> list[float]:
        """Pass seconds by width for this batch at the context its rows hold now."""
        assert self.costs is not None
        context = self._context(rows)
        return [self.costs.seconds(len(rows), w, context) for w in range(1, self.costs.max_width + 1)]

    def _context(self, rows: list[Row]) -> float:
        """The mean context the rows have cached."""
        return sum(self.cache.length(r.seq) for r in rows) / max(len(rows), 1)

    def _choose_verified(
        self, rows: list[Row], ks: list[int], drafts: list[list[int]], predicted: list[np.ndarray], spent_s: float
    ) -> None:
        """How much of each proposal to verify, from its positions' predicted acceptance: drafts
        are cut in place, and a row whose proposal is cut to nothing asked for nothing this step."""
        outlooks = [
            RowOutlook(r.drafter.name, 0.0, 1.0, len(d), tuple(p.tolist()))
            if r.drafter is not None and len(d) and len(p)
            else RowOutlook(None, 0.0, 0.0, 0)
            for r, d, p in zip(rows, drafts, predicted, strict=True)
        ]
        if not any(o.drafter for o in outlooks):
            return
        drawn: dict[str, int] = {}  # per drafter, its longest proposal: every step of it is spent
        for outlook, d in zip(outlooks, drafts, strict=True):
            if outlook.drafter is not None:
                drawn[outlook.drafter] = max(drawn.get(outlook.drafter, 0), len(d))
        pass_s = self._pass_seconds(rows)
        chosen = plan_step(outlooks, pass_s, {}, self.k_max, drafted=drawn, spent_seconds=spent_s)
        probe = max((w for w in range(1, len(pass_s)) if pass_s[w] <= PROBE_COST * pass_s[0]), default=0)
        for b, (outlook, j) in enumerate(zip(outlooks, chosen, strict=True)):
            if outlook.drafter is None:
                continue
            j = _explore(rows[b], j, probe)
            if j < len(drafts[b]):
                del drafts[b][j:]
                predicted[b] = predicted[b][:j]
                ks[b] = j

    def _judge(self, rows: list[Row], group: list[int], caps: list[int], started: float) -> DraftJudge:
        """While a drafter drafts for `group` (indices into rows): after each draft step, draw on
        only while the step's plan, with what was drawn so far predicted, wants more drawn."""
        drafter = rows[group[0]].drafter
        assert drafter is not None
        name, predictor = drafter.name, self.predictors[drafter.name]
        step_s = self.drafter_costs[name].step_s.get(batch_bucket(len(group)), 0.0)
        pass_s = self._pass_seconds(rows)

        def judge(steps: int, features: list[np.ndarray]) -> list[bool]:
            outlooks = [RowOutlook(None, 0.0, 0.0, 0) for _ in rows]
            for b, f, cap in zip(group, features, caps, strict=True):
                a = predictor.predict(f, rows[b].offset)
                # Positions not drawn yet are expected to do as well as the last one drawn.
                outlooks[b] = RowOutlook(name, float(a[-1]) if len(a) else 0.0, 1.0, cap, tuple(a.tolist()))
            spent = time.perf_counter() - started
            plan = plan_step(outlooks, pass_s, {name: step_s}, self.k_max, drafted={name: steps}, spent_seconds=spent)
            return [plan[b] > steps for b in group]

        return judge

    def _k_cap(self, row: Row, batch: int) -> int:
        if row.drafter is None:
            return 0
        state = row.state
        k = self.k_max if row.drafter.max_draft is None else min(self.k_max, row.drafter.max_draft)
        left = state.request.max_tokens - len(state.token_ids)
        room = (self.plain.context_length or 1 << 30) - row.draft.length
        fits = self.settings.max_step_tokens // batch  # the step's token budget bounds the pass width
        if row.drafter.widest_block > fits:  # a structured block is all or nothing
            return 0
        # A step emits up to k + 1 tokens: never draft past max_tokens or the context.
        return max(0, min(k, left - 1, room - 1, fits - 1))

    def _propose(self, rows: list[Row], ks: list[int]) -> _Proposed:
        """Each drafter drafts for its rows that asked; drafts per row with their features and
        predicted acceptance, q over the batch (None when every draft is deterministic or no
        sampling row drafted) and what drafting took."""
        drafts: list[list[int]] = [[] for _ in rows]
        features, predicted = [np.zeros((0, 0)) for _ in rows], [np.zeros(0) for _ in rows]
        proposals: dict[str, tuple[list[int], Proposal]] = {}
        structured: list[StructuredDraft | None] = [None for _ in rows]
        drafting = _Drafting()
        for name, drafter in self.drafters.items():
            group = [b for b, r in enumerate(rows) if r.drafter is drafter and ks[b] > 0]
            if not group:
                continue
            drafting.backlog[name] = _backlog(drafter, [rows[b] for b in group])
            started = time.perf_counter()
            group_ks = [ks[b] for b in group]
            judge = self._judge(rows, group, group_ks, started) if self.k == "auto" and not drafter.free else None
            try:
                proposal = drafter.propose([rows[b].draft for b in group], group_ks, judge)
                if proposal.features is not None:
                    for b, f in zip(group, proposal.features, strict=True):
                        features[b] = f[: ks[b]]
                        predicted[b] = self.predictors[name].predict(features[b], rows[b].offset)
            except Exception as exc:  # a drafter failure ends its rows only
                self._fail_all([rows[b] for b in group], exc)
                continue
            drafting.seconds[name] = time.perf_counter() - started
            drafting.steps[name] = max((len(t) for t in proposal.tokens), default=0)
            drafting.rows[name] = len(group)
            proposals[name] = (group, proposal)
            for b, tokens in zip(group, proposal.tokens, strict=True):
                drafts[b] = list(tokens[: ks[b]])
            for b, block in zip(group, proposal.structured or [], strict=False):
                structured[b] = block
        q = self._draft_probs(rows, drafts, proposals, structured)
        return _Proposed(drafts, features, predicted, q, drafting, structured)

    def _draft_probs(
        self,
        rows: list[Row],
        drafts: list[list[int]],
        proposals: dict[str, tuple[list[int], Proposal]],
        structured: list[StructuredDraft | None],
    ) -> torch.Tensor | None:
        """q (B, K, V) for the sampling rows' drafted chains: a drafter's own q, one-hot for
        deterministic drafts. None when no sampling row drafted a chain."""
        sampled = [b for b, r in enumerate(rows) if not r.draft.sampling.greedy and drafts[b] and structured[b] is None]
        if not sampled:
            return None
        width = max(len(d) for d in drafts)
        q = torch.zeros((len(rows), width, self.cache.vocab_size), dtype=torch.float32, device=self.cache.device)
        for group, proposal in proposals.values():
            for j, b in enumerate(group):
                if b not in sampled:
                    continue
                n = len(drafts[b])
                if proposal.q is not None:
                    q[b, :n] = proposal.q[j, :n].to(q.dtype)
                else:
                    q[b, torch.arange(n), torch.tensor(drafts[b])] = 1.0
        return q

    def _verify(
        self,
        rows: list[Row],
        drafts: list[list[int]],
        q: torch.Tensor | None,
        logits: torch.Tensor,
        structured: list[StructuredDraft | None],
    ) -> _Verified:
        """Accepted count and emitted tokens per row: chains as `_verify_chains`, structured blocks
        by the multi-candidate rule (`_verify_candidates`). A structured row's entry in `drafts`
        becomes the candidate it judged, so the books count what was verified."""
        chains = [b for b, s in enumerate(structured) if s is None]
        if len(chains) == len(rows):
            return self._verify_chains(rows, drafts, q, logits)
        verified = _Verified([0] * len(rows), [[] for _ in rows], [0] * len(rows))
        if chains:
            part = self._verify_chains(
                [rows[b] for b in chains],
                [drafts[b] for b in chains],
                None if q is None else q[chains],
                logits[chains],
            )
            for j, b in enumerate(chains):
                verified.accepted[b], verified.emitted[b] = part.accepted[j], part.emitted[j]
        for b, s in enumerate(structured):
            if s is None:
                continue
            verdict = self._verify_candidates(rows[b], s, logits[b, : len(s.tokens)])
            drafts[b] = list(s.candidates[verdict.branch]) if s.candidates else []
            accepted = drafts[b][: verdict.accepted]
            verified.accepted[b], verified.branches[b] = verdict.accepted, verdict.branch
            verified.emitted[b] = [*accepted, verdict.next_token]
        return verified

    @staticmethod
    def _verify_candidates(row: Row, structured: StructuredDraft, logits: torch.Tensor) -> CandidateVerdict:
        """One row's structured block (logits (L, V)): the candidate prefix the target keeps and
        its next token — the argmax chain for a greedy row, SpecInfer's rule for a sampling one."""
        if row.draft.sampling.greedy:
            return accept_candidates_greedy(
                structured.candidates, candidate_chains(logits.argmax(-1), structured.branches)
            )
        p = target_probs(logits.unsqueeze(0), [row.draft.sampling])[0]
        chains = candidate_chains(p, structured.branches)
        return accept_candidates_sampled(structured.candidates, chains, row.draft.generator)

    def _observe_blocks(self, rows: list[Row], structured: list[StructuredDraft | None], logits: torch.Tensor) -> None:
        """Drafters of structured blocks read the target's argmax over their blocks."""
        for drafter in self.drafters.values():
            group = [
                b
                for b, (r, s) in enumerate(zip(rows, structured, strict=True))
                if s is not None and r.drafter is drafter
            ]
            if group:
                argmax = [logits[b, : len(structured[b].tokens)].argmax(-1) for b in group]
                self._guarded(drafter.observe_block, [rows[b] for b in group], argmax)

    def _verify_chains(
        self, rows: list[Row], drafts: list[list[int]], q: torch.Tensor | None, logits: torch.Tensor
    ) -> _Verified:
        """Accepted count and emitted tokens per row: greedy rows by argmax, sampling rows exactly
        (speculative sampling; a row without drafts samples its next token as plain decoding does)."""
        draft_width = max(len(d) for d in drafts)
        logits = logits[:, : draft_width + 1]
        if draft_width == 0:  # a plain step: the same draws as the plain engine
            params, gens = [r.draft.sampling for r in rows], [r.draft.generator for r in rows]
            tokens = sample_tokens(logits[:, 0], params, gens).tolist()
            return _Verified([0] * len(rows), [[int(t)] for t in tokens], [0] * len(rows))
        padded = torch.zeros((len(drafts), draft_width), dtype=torch.long, device=logits.device)
        for b, d in enumerate(drafts):
            padded[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        lengths = torch.tensor([len(d) for d in drafts], device=logits.device)
        accepted, next_tokens = accept_greedy(padded, lengths, logits.argmax(dim=-1))
        sampled = [b for b, r in enumerate(rows) if not r.draft.sampling.greedy]
        if sampled:
            params = [rows[b].draft.sampling for b in sampled]
            p = target_probs(logits[sampled], params)
            if q is not None and len(sampled) < len(rows):
                q = q[sampled]
            q_rows = None if q is None else q[:, :draft_width]
            gens = [rows[b].draft.generator for b in sampled]
            accepted[sampled], next_tokens[sampled] = accept_sampled(padded[sampled], lengths[sampled], p, q_rows, gens)
        counts = accepted.tolist()
        emitted = [d[:n] + [int(t)] for d, n, t in zip(drafts, counts, next_tokens.tolist(), strict=True)]
        return _Verified(counts, emitted, [0] * len(rows))

    def _observe(
        self, rows: list[Row], ks: list[int], drafts: list[list[int]], accepted: list[int], asked: list[int]
    ) -> None:
        """Drafters roll back past their rejected (or unverified) drafts; α and ρ estimates learn
        the outcome of what was verified."""
        for drafter in self.drafters.values():
            group = [b for b, r in enumerate(rows) if r.drafter is drafter and asked[b] > 0]
            if group:
                self._guarded(drafter.observe, [rows[b] for b in group], [accepted[b] for b in group])
        for row, k, d, n in zip(rows, ks, drafts, accepted, strict=True):
            if row.outlook is not None and row.drafter is not None and not row.done:
                row.outlook.observe(k, len(d), n)
                self.outlooks[row.drafter.name].observe(k, len(d), n)

    def _observe_declined(self, rows: list[Row], ks: list[int], drawn: list[int], first: list[float | None]) -> None:
        """Rows whose proposal was drafted and then not verified at all: their α and ρ estimates
        learn the first position's predicted acceptance instead of an outcome."""
        for row, k, n, p in zip(rows, ks, drawn, first, strict=True):
            if k == 0 and n and p is not None and row.outlook is not None and row.drafter is not None:
                row.outlook.observe_declined(p)
                self.outlooks[row.drafter.name].observe_declined(p)

    def _learn(
        self,
        rows: list[Row],
        drafts: list[list[int]],
        features: list[np.ndarray],
        predicted: list[np.ndarray],
        accepted: list[int],
    ) -> None:
        """Each verified proposal's judged positions — the accepted ones and the first rejected
        one — teach its drafter's map and correct the request's own offset."""
        for row, d, f, p, n in zip(rows, drafts, features, predicted, accepted, strict=True):
            if row.probing:  # an accepted probe says drafts pay here again; a rejected one, probe rarer
                row.probing = False
                row.probe_every = PROBE_EVERY if n else min(2 * row.probe_every, PROBE_RARELY)
            if row.drafter is None or not len(d) or len(p) < len(d):
                continue
            judged = min(n + 1, len(d))
            labels = [1.0] * min(n, len(d)) + [0.0] * (judged - min(n, len(d)))
            row.offset = refine_offset(row.offset, p[:judged], labels)
            self.predictors[row.drafter.name].learn(f[:judged], labels, row.key, p[:judged].tolist())

    def _report_features(self, rows: list[Row], counts: list[int]) -> None:
        """Feature drafters get the target's hidden states of each row's newly verified tokens."""
        for drafter in self.drafters.values():
            if not drafter.feature_layers:
                continue
            group = [b for b, r in enumerate(rows) if r.drafter is drafter and not r.done]
            if group:
                features = self.cache.features(drafter.feature_layers)
                # Copies: a view would keep the whole batch's features alive while a row waits to draft.
                fed = [features[b, : counts[b]].clone() for b in group]
                self._guarded(drafter.observe_target, [rows[b] for b in group], fed)

    def _guarded(self, call: Callable[[list[DraftRow], list], None], rows: list[Row], values: list) -> None:
        """A drafter's bookkeeping call for its rows: if it fails, those rows end, no others."""
        try:
            call([r.draft for r in rows], values)
        except Exception as exc:
            self._fail_all(rows, exc)

    def _record(
        self,
        rows: list[Row],
        ks: list[int],
        asked: list[int],
        declined: list[int],
        drafts: list[list[int]],
        accepted: list[int],
        drafting: _Drafting,
        verify_s: float,
        forward_s: float,
        width: int,
        context: float,
    ) -> None:
        """Statistics per row and per drafter, and the measured costs the planner reads. `ks` is
        what each row's verified draft stands for (its k for α and ρ), `asked` what it drafted for,
        `declined` how many drafted tokens the verify choice cut; `context` the rows' mean cached
        context the pass read (taken before it: a row that failed since has no cache left)."""
        batch = len(rows)
        if self.costs is None:
            return
        self.costs.record_target(batch, width, forward_s, context)
        step_s = self.costs.seconds(batch, 1, context)
        for name, drafter in self.drafters.items():
            group = [b for b, r in enumerate(rows) if r.drafter is drafter]
            if not group:
                continue
            draft_s = drafting.seconds.get(name, 0.0)
            if name in drafting.seconds:
                costs = self.drafter_costs[name]
                costs.record(drafting.rows[name], drafting.steps[name], draft_s, drafting.backlog[name])
            drafted, ok = [len(drafts[b]) for b in group], [accepted[b] for b in group]
            totals = self.drafter_totals[name]
            totals.target_step_s = step_s
            cut = sum(declined[b] for b in group)
            totals.record(max(drafted), drafted, ok, draft_s, verify_s, [ks[b] for b in group], cut, width)
        for row, k, first, cut, d, n in zip(rows, ks, asked, declined, drafts, accepted, strict=True):
            stats = row.stats
            if stats is None or row.drafter is None:
                continue
            stats.target_step_s = step_s
            # A row pays drafting time on the steps it drafted in, verified or not.
            draft_s = drafting.seconds.get(row.drafter.name, 0.0) if first else 0.0
            stats.record(len(d), [len(d)], [n], draft_s, verify_s, requested=[k], declined=cut, width=width)

    # -- rows leaving -----------------------------------------------------------------------
    def _emit(self, row: Row, tokens: list[int]) -> None:
        """Append tokens one by one, stopping where the row finishes (then it leaves)."""
        if row.done:  # it failed earlier in this step
            return
        try:
            for token in tokens:
                if row.state.append(token, self.tokenizer):
                    self._retire(row)
                    return
        except Exception as exc:  # a listener or stop-string check failed: this row alone ends
            self._fail(row, exc)

    def _retire(self, row: Row) -> None:
        if row.done:
            return
        row.done = True
        if row.seq >= 0:
            if row.error is None:  # the answer's verified blocks too: a conversation's next turn starts with them
                self.cache.commit(row.seq, [*row.state.prompt_ids, *row.state.token_ids])
            self.cache.remove(row.seq)
        if row.drafter is not None:
            try:
                row.drafter.release(row.key)
            except Exception:  # the row is gone either way; a drafter that cannot forget it only leaks
                log.exception("drafter %s failed to release request %d", row.drafter.name, row.key)

    def _fail(self, row: Row, exc: BaseException) -> None:
        log.warning("request %d failed in the step loop: %s: %s", row.key, type(exc).__name__, exc)
        row.error = exc
        self._retire(row)
        if row.on_failure is not None:
            try:
                row.on_failure(exc)
            except Exception:  # nobody is listening any more
                log.debug("failure of request %d not delivered", row.key)

    def _fail_all(self, rows: list[Row], exc: BaseException) -> None:
        for row in rows:
            self._fail(row, exc)


def _backlog(drafter: Drafter, rows: list[Row]) -> int:
    """Context tokens `drafter` must read before drafting for those of `rows` it serves."""
    return sum(drafter.backlog(r.draft) for r in rows if r.drafter is drafter)


def step_costs(
    loaded: LoadedModel, max_width: int, settings: LoopSettings | None = None, context: ContextCurve | None = None
) -> StepCosts:
    """A step-cost table for this target, probed per batch bucket on first use, through passes
    shaped as the loop with these settings runs them (width-invariant or not); with a measured
    `context` curve, read at the context the rows hold (the table at the curve's reference)."""
    loop = settings or LoopSettings()
    tile = loop.tile(loaded.info.dtype)

    def probe(batch: int, widths: Sequence[int]) -> dict[int, float]:
        if loop.engine == "llamacpp":
            from .engines import gguf_file
            from .engines.llamacpp import measure_llamacpp_step_times

            # Resolved per probe (a new batch bucket) but cheap: a file's content hash is read once a process.
            return measure_llamacpp_step_times(
                gguf_file(loaded, loop.gguf_weights), batch, widths, torch.get_num_threads()
            )
        return measure_step_times(loaded.model, batch, widths, tile=tile, tile_rows=loop.tile_max_rows)

    if context is None:
        return StepCosts(probe, max_width=max_width)
    return StepCosts(probe, max_width=max_width, context_scale=context.factor, table_context=context.reference)


def seeded_step_costs(
    loaded: LoadedModel,
    curve: CostCurve,
    settings: LoopSettings | None = None,
    max_width: int = 0,
    context: ContextCurve | None = None,
) -> StepCosts:
    """The step-cost table started from a measured curve (a profile's, measured at `context`'s
    reference context when one is given), so no request waits for a timing probe; widths up to
    `max_width` the curve lacks are probed on first use."""
    costs = step_costs(loaded, max(curve.max_width, max_width), settings, context)
    for b, row in zip(curve.batches, curve.seconds, strict=True):
        if b & (b - 1) == 0:  # the table is keyed by power-of-two buckets
            costs.target_s.update({(b, w): s for w, s in zip(curve.widths, row, strict=True)})
    return costs


def _explore(row: Row, verified: int, probe: int) -> int:
    """How many drafted tokens a row verifies once auto k chose `verified`: a proposal declined
    outright counts towards the next probe, which verifies up to `probe` of them (none: probes
    wait for cheaper passes). The choice reads only counts of earlier steps and the pass costs,
    never this proposal's tokens, so it is a stopping rule like auto k's and the output stays
    exactly the target's."""
    if verified:
        row.declined, row.probe_every = 0, PROBE_EVERY
        return verified
    row.declined += 1
    if row.declined < row.probe_every or not probe:
        return 0
    row.declined, row.probing = 0, True
    return probe


def seeded_draft_costs(profile: Profile | None, names: list[str], max_batch: int) -> dict[str, DraftCosts]:
    """Each profiled drafter's seconds per draft step at every batch bucket up to max_batch, so no
    drafter is planned as free before the loop has timed it."""
    if profile is None:
        return {}
    measured = {d.name: d for d in profile.drafters}
    buckets = [1 << i for i in range(max(max_batch - 1, 0).bit_length() + 1)]
    return {
        name: DraftCosts(step_s={b: measured[name].step_at(b) for b in buckets}) for name in names if name in measured
    }


def profile_acceptance_maps(profile: Profile | None) -> dict[str, AcceptanceMap]:
    """Each profiled drafter's per-proposal acceptance map (the loop refines it as it serves)."""
    return {} if profile is None else {m.drafter: m for m in profile.acceptance_maps}
