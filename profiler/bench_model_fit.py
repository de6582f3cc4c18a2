"""`specroute bench model-fit`: does the cost model predict what speculation really does?

For each category × batch b × fixed k, the speculative engine and the plain engine decode the same
prompts in the same run (every configuration of a batch back to back, rotating which goes first),
and the measured decode speedup is set against the cost model's prediction E(α, k) / (k·c + v(b, k))
with c and v from the profile, read at the context the cell's rows hold (their prompts and half the
answer). Three predictions are shown: from the α and ρ measured in that very run (the cost model's
own error), from the profile's α and ρ for the category, and from the α and ρ the predictor gives
each prompt before it runs (what the router knows). By default the prompts are the held-out set,
which neither the profile nor the predictor saw.

The error is reported where it matters: per cell, per category and per batch; the break-even
concurrency in grid steps; and the share of cells where routing on a prediction picks a backend
measured ≥ 5% slower than the other. The backends are those the service runs: in every cell the
speculative backend as served (the step loop choosing k per step, with the profile's draft costs
and acceptance maps) is timed beside plain decoding, and the policy's own `decide()` routes from
each prediction; the share that also counts the k picked (plain, or speculation at the k
predicted best among the fixed ones) is shown beside it.

The predictor is scored per prompt on every prompt of the set's categories (not just the cells'
few), greedy at the profile's k over answers as long as its training samples': what it predicts
is the α and ρ such an answer achieves. Each answer is then decoded on for as many tokens again,
and the α and ρ of that second half set against the first: how far a prompt's own acceptance moves
within one answer, the spread no prediction made before decoding can be expected to beat.

What is timed is decoding with the whole batch in every pass, as the cost model assumes and a
serving loop keeps it (finished requests make room for new ones): both engines run the step loop
the backends serve with (plain: no drafter), told to prefill every row in the first step; from
the end of that step until the first row has its max_tokens (EOS ignored), every step runs every
row, and those steps' tokens over their seconds are the rate. (Timing a static batch to its end
instead would count the prefill of rows whose prompts came in later chunks, and the last steps in
which the rows that drew fewer accepted tokens run nearly alone.) Each engine first runs once
untimed at every batch size (kernel set-up for new shapes is not decoding).

A batch larger than the category's prompts repeats them; greedy copies of a prompt propose in the
very same steps, so the chance that some row drafts (which widens the shared pass) is computed over
the distinct prompts of the batch.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from tqdm import tqdm

from backends.generation import GenerationRequest, GenerationResult
from backends.models import LoadedModel, load_model
from backends.plain import PlainEngine
from backends.scheduler import (
    LoopSettings,
    Scheduler,
    profile_acceptance_maps,
    seeded_draft_costs,
    seeded_step_costs,
)
from backends.speculative.control import StepCosts
from backends.speculative.drafters import Drafter
from backends.speculative.engine import SpeculativeEngine
from backends.speculative.factory import build_drafter
from backends.speculative.stats import SpeculationStats
from policies.config import parse_policy
from policies.cost_model import break_even_concurrency, speedup, tokens_per_step
from policies.drafters import KINDS, DrafterConfig, DrafterKind
from policies.estimates import ProfileCosts, decode_context
from policies.policy import AlphaInput, LoadSnapshot, RequestFeatures, decide
from policies.profile import AcceptanceProfile, Profile, ProfileError

from .hardware import MachineInfo, machine_info
from .predictor import AlphaPredictor
from .profiling import ProfileConfig, default_profile_path
from .settings import ModelSettings
from .workloads import PromptSet, PromptSetName, WorkloadPrompt, check_categories, load_prompt_set

PLAIN = "plain"
SERVED = "served"  # the speculative backend as the service runs it: k chosen per step
SPECULATIVE = "speculative"
AlphaSource = Literal["predicted", "profile", "run"]
ALPHA_SOURCES: tuple[AlphaSource, ...] = ("predicted", "profile", "run")
SOURCE_NAMES: dict[AlphaSource, str] = {"predicted": "the predictor's", "profile": "the profile's", "run": "the run's"}
MAX_STEP_TOKENS = 65536  # the step loop's largest step: every row's whole prompt at once
WRONG_IF_SLOWER = 0.05  # a routing choice is wrong when what it picked measured this much slower than the best


class ModelFitConfig(ModelSettings):
    profile: str | None = Field(None, description="profile path (default: this model's under SPECROUTE_HOME)")
    drafter: DrafterKind = KINDS[0]
    drafter_options: DrafterConfig = Field(default_factory=DrafterConfig)
    categories: list[str] | None = None
    ks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    batches: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1)
    max_tokens: int = Field(
        64,
        ge=4,
        le=1024,
        description="tokens per row; the timed window ends where a row has no room for max(ks) drafts",
    )
    prompts_per_category: int = Field(2, ge=1)
    repeats: int = Field(
        2, ge=1, le=10, description="runs of every engine per batch, the fastest kept (as the profile keeps its best)"
    )
    prompt_set: PromptSetName = Field(
        "heldout", description="which prompt set the cells run ('heldout': none of it tuned the profile or predictor)"
    )
    predictor_prompts: int | None = Field(
        None,
        ge=0,
        description="prompts per category that score the α/ρ predictor (None: every prompt of the set; 0: no scoring)",
    )

    _known_categories = field_validator("categories")(check_categories)

    @field_validator("ks", "batches")
    @classmethod
    def _increasing(cls, values: list[int]) -> list[int]:
        if values != sorted(set(values)) or values[0] < 1:
            raise ValueError(f"must be positive and strictly increasing (got {values})")
        return values

    @model_validator(mode="after")
    def _room_for_whole_steps(self) -> ModelFitConfig:
        # The first step gives a row up to k + 2 tokens (its first, then a step of drafts); the window
        # then needs rows with room for a whole step of max(ks) drafts and their bonus token, at
        # least twice to say anything.
        least = 3 * (max(self.ks) + 1) + 1
        if self.max_tokens < least:
            raise ValueError(
                f"max_tokens must be at least {least} with k up to {max(self.ks)} (got {self.max_tokens}): the timed "
                "window runs while every row has room for a whole step of drafts"
            )
        return self


class FitPoint(BaseModel):
    category: str
    batch: int
    k: int
    alpha: float = Field(description="α measured in this run (accepted / judged on steps with a proposal)")
    proposal_rate: float = Field(description="ρ measured in this run: steps in which the drafter proposed")
    alpha_profile: float
    proposal_rate_profile: float
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    measured: float = Field(description="measured decode speedup over plain")
    predicted: float = Field(description="cost model with this run's α and the profile's c, v")
    predicted_profile: float = Field(description="cost model with the profile's α for the category")
    alpha_predicted: float | None = Field(None, description="the predictor's α, mean over the cell's prompts")
    proposal_rate_predicted: float | None = Field(None, description="the predictor's ρ, mean over the cell's prompts")
    predicted_prompt: float | None = Field(None, description="cost model with the predictor's α and ρ per prompt")
    context: float | None = Field(None, description="mean cached context of the cell's rows the costs were read at")
    identical: bool = Field(description="greedy tokens equal the plain engine's on every row (those both produced)")
    tokens: int = Field(description="tokens the speculative engine decoded while every row ran")
    plain_seconds: float
    spec_seconds: float

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


class BreakEven(BaseModel):
    category: str
    measured: int | None = Field(description="smallest measured batch where no k beats plain (None: none)")
    predicted: int | None = Field(description="the same on the grid, from the cost model with the run's α")
    predicted_scan: int | None = Field(description="smallest concurrency the profile alone predicts (integer scan)")
    predicted_prompt: int | None = Field(None, description="the same on the grid, from the predictor's α and ρ")
    steps_off: int | None = Field(None, description="grid steps between measured and predicted (run's α)")
    steps_off_prompt: int | None = Field(None, description="grid steps between measured and predicted_prompt")


class ErrorGroup(BaseModel):
    """Mean absolute percentage error of the cells in one category or at one batch size."""

    name: str
    cells: int
    mape: float = Field(description="prediction from the run's α")
    mape_profile_alpha: float
    mape_predicted: float | None = None


class PromptFit(BaseModel):
    """One prompt's answer, greedy at the profile's k: the α and ρ of its first half (as long as the
    profile's answers) and of its second, and what was predicted for it."""

    category: str
    prompt_id: str
    prompt_tokens: int
    alpha: float
    proposal_rate: float
    judged_tokens: int
    requested_steps: int = Field(description="steps that asked the drafter for tokens (the evidence behind ρ)")
    alpha_rest: float = Field(description="α over the answer's second half")
    proposal_rate_rest: float
    judged_tokens_rest: int = Field(description="0: the answer ended (or never proposed) in its first half")
    requested_steps_rest: int
    alpha_predicted: float
    proposal_rate_predicted: float
    alpha_category: float = Field(description="the profile's α for the category")
    proposal_rate_category: float
    alpha_online: float = Field(description="predicted after the prompts scored before it had fed back their α")
    proposal_rate_online: float


class PredictorFit(BaseModel):
    """Mean absolute error over the prompts: the predictor (before any traffic, and online), the
    profile's category mean, a constant, and the answer's second half against its first; each also
    weighted by the prompt's evidence (α: judged tokens, ρ: steps that asked; the halves: the
    smaller half's), which is how much of the decoding each prompt's error steers."""

    target: str
    prompts: int
    mae_predictor: float
    mae_online: float
    mae_category: float
    mae_constant: float
    weighted_mae_predictor: float
    weighted_mae_online: float
    weighted_mae_category: float
    weighted_mae_constant: float
    halves_prompts: int = Field(0, description="prompts with evidence in both halves of the answer")
    mae_halves: float | None = Field(None, description="|first half - second half| (None: no such prompt)")
    weighted_mae_halves: float | None = None


class BackendRouting(BaseModel):
    """A cell's backend as the policy routes it from each prediction: the speculative backend as
    served (k chosen per step) or plain; a choice is wrong when it measured slower than the other."""

    category: str
    batch: int
    served: float = Field(description="the speculative backend as served, measured over plain")
    best: str
    chosen: dict[AlphaSource, str]
    loss: dict[AlphaSource, float] = Field(description="how much slower the chosen backend measured than the best")


class ServedPoint(BaseModel):
    """The speculative backend as served (auto k) in one cell, against plain decoding."""

    category: str
    batch: int
    tokens_per_s: float
    measured: float = Field(description="measured decode speedup over plain")
    alpha: float
    proposal_rate: float
    mean_k: float = Field(description="drafted tokens verified per step, on average")
    identical: bool


class RoutingCheck(BaseModel):
    """A cell's routing choice (plain or speculation at the predicted best k) from a prediction."""

    category: str
    batch: int
    best: str = Field(description="the fastest option measured")
    chosen_predicted: str
    chosen_profile: str
    chosen_run: str
    loss_predicted: float = Field(description="how much slower the predicted choice measured than the best")
    loss_profile: float
    loss_run: float


class ModelFitReport(BaseModel):
    machine: MachineInfo
    model: dict[str, object]
    config: ModelFitConfig
    profile_created: str
    points: list[FitPoint]
    mape: float = Field(description="mean absolute percentage error, prediction from the run's α")
    mape_profile_alpha: float
    mape_predicted: float | None = Field(None, description="prediction from the predictor's α and ρ per prompt")
    break_even: list[BreakEven]
    by_category: list[ErrorGroup] = Field(default_factory=list)
    by_batch: list[ErrorGroup] = Field(default_factory=list)
    prompts: list[PromptFit] = Field(default_factory=list)
    predictor: list[PredictorFit] = Field(default_factory=list)
    routing: list[RoutingCheck] = Field(default_factory=list)
    served: list[ServedPoint] = Field(default_factory=list)
    backend_routing: list[BackendRouting] = Field(default_factory=list)

    def wrong_share(self, which: AlphaSource) -> float:
        """Share of cells whose choice (plain or a k) measured ≥ WRONG_IF_SLOWER slower than the best option."""
        return _wrong_share([getattr(r, f"loss_{which}") for r in self.routing])

    def wrong_backend_share(self, which: AlphaSource) -> float:
        """Share of cells routed to a backend measured ≥ WRONG_IF_SLOWER slower than the other."""
        return _wrong_share([r.loss[which] for r in self.backend_routing])


def _wrong_share(losses: list[float]) -> float:
    return sum(loss >= WRONG_IF_SLOWER for loss in losses) / max(len(losses), 1)


def run_model_fit(config: ModelFitConfig, progress: bool = True) -> ModelFitReport:
    path = Path(config.profile) if config.profile else default_profile_path(config.model, config.dtype, config.device)
    profile = Profile.load(path)
    loaded = load_model(config.model, dtype=config.dtype, device=config.device, threads=config.threads)
    if profile.model.name != loaded.info.name or profile.model.dtype != loaded.info.dtype:
        raise ProfileError(f"{path} profiles {profile.model.name} ({profile.model.dtype}), not this model")
    # Every row is prefilled in the first step, so the first token ends the shared prefill for every
    # row of both engines and what is timed after it is decoding alone.
    loop = LoopSettings(
        max_batch=max(config.batches),
        max_step_tokens=MAX_STEP_TOKENS,
        prefill_chunk=MAX_STEP_TOKENS,
        prefix_caching=False,  # every run prefills its prompts, as the model fits them
    )
    costs = seeded_step_costs(loaded, profile.target, loop, context=profile.context)
    if max(config.ks) + 1 > costs.max_width:
        raise ProfileError(f"the profile measured passes up to {costs.max_width} tokens: k ≤ {costs.max_width - 1}")
    drafter = build_drafter(config.drafter_options.of(config.drafter), loaded)
    prompt_set = load_prompt_set(config.prompt_set)
    categories = config.categories or list(prompt_set.categories)
    for category in categories:  # every prediction input must exist before anything is timed
        profile.acceptance_for(category, drafter.name)
    predictors = _Predictors.of(profile)
    plain = PlainEngine(loaded)  # for its tokenizer's chat template
    engines = _engines(loaded, loop, costs, drafter, profile, config)
    grid = [(c, b) for c in categories for b in config.batches]
    points, served, routes, order, outlooks = [], [], [], _Rotation(list(engines)), _Outlooks()
    warmed: set[int] = set()
    for category, batch in tqdm(grid, desc="model fit", unit="cell", disable=not progress):
        prompts = prompt_set.categories[category].prompts[: config.prompts_per_category]
        requests = [
            GenerationRequest(messages=p.messages, max_tokens=config.max_tokens, ignore_eos=True) for p in prompts
        ]
        if batch not in warmed:
            _warm_up(engines, requests, batch, max(config.ks))
            warmed.add(batch)
        measured = _measure_cell(engines, requests, batch, order, max(config.ks), config.repeats)
        outlook = outlooks.of(prompts, requests, plain, predictors, drafter.name, category, config.max_tokens)
        points += _fit_points(category, batch, config, measured, profile, drafter.name, outlook)
        served.append(_served_point(category, batch, measured))
        routes.append(_backend_routing(served[-1], measured, outlook, profile, drafter.name, config))
    fits = _score_predictor(loaded, drafter, profile, prompt_set, categories, predictors, config, progress)
    return _report(config, loaded.info.as_dict(), profile, points, fits, served, routes)


def _engines(
    loaded: LoadedModel,
    loop: LoopSettings,
    costs: StepCosts,
    drafter: Drafter,
    profile: Profile,
    config: ModelFitConfig,
) -> dict[str, Scheduler]:
    """Plain decoding, the speculative backend as served (auto k up to the grid's largest k, started
    from the profile's draft costs and acceptance map, as a replica starts) and each fixed k, all
    the step loop the backends serve with: the same paged cache and passes."""
    served = Scheduler(
        loaded,
        loop,
        [drafter.fresh()],
        "auto",
        max(config.ks),
        costs,
        seeded_draft_costs(profile, [drafter.name], loop.max_batch),
        profile_acceptance_maps(profile),
    )
    engines: dict[str, Scheduler] = {PLAIN: Scheduler(loaded, loop), SERVED: served}
    for k in config.ks:
        engines[f"k={k}"] = SpeculativeEngine(loaded, drafter.fresh(), k=k, costs=costs, settings=loop)
    return engines


class _Predictors:
    """The α and ρ predictors fitted on the profile's samples (before anything is timed: a profile
    without samples is refused up front)."""

    def __init__(self, alpha: AlphaPredictor, rho: AlphaPredictor):
        self.alpha, self.rho = alpha, rho

    @classmethod
    def of(cls, profile: Profile) -> _Predictors:
        return cls(AlphaPredictor.from_profile(profile), AlphaPredictor.from_profile(profile, target="proposal_rate"))

    def predict(self, request: GenerationRequest, tokens: int, drafter: str, category: str) -> tuple[float, float]:
        """(α, ρ) for one prompt, as the router predicts them when the caller names the category."""
        text, turns = request.text_and_turns()
        alpha = self.alpha.predict(text, turns, tokens, drafter, category).alpha
        return alpha, self.rho.predict(text, turns, tokens, drafter, category).alpha

    def observe(
        self, request: GenerationRequest, tokens: int, drafter: str, category: str, stats: SpeculationStats
    ) -> None:
        """What a finished request achieved, fed back as the router does: α from accepted of judged
        tokens, ρ from drafts of the steps that asked."""
        text, turns = request.text_and_turns()
        if stats.judged_tokens:
            self.alpha.observe(text, turns, tokens, drafter, category, stats.accepted_tokens, stats.judged_tokens)
        if stats.requested_steps:
            self.rho.observe(text, turns, tokens, drafter, category, stats.drafts, stats.requested_steps)


class _Outlook(BaseModel):
    """What is known about a cell's prompts before it runs."""

    category: str
    context: float
    tokens: list[int] = Field(description="each prompt's length in tokens")
    alphas: list[float]
    rhos: list[float]


class _Outlooks:
    """Per prompt, across the whole bench: its length in tokens and its predicted α and ρ."""

    def __init__(self) -> None:
        self.prompts: dict[str, tuple[int, float, float]] = {}

    def of(
        self,
        prompts: Sequence[WorkloadPrompt],
        requests: Sequence[GenerationRequest],
        plain: PlainEngine,
        predictors: _Predictors,
        drafter: str,
        category: str,
        max_tokens: int,
    ) -> _Outlook:
        for prompt, request in zip(prompts, requests, strict=True):
            if prompt.id not in self.prompts:
                tokens = len(plain.encode(request))
                self.prompts[prompt.id] = (tokens, *predictors.predict(request, tokens, drafter, category))
        known = [self.prompts[p.id] for p in prompts]
        return _Outlook(
            category=category,
            context=decode_context(_mean([k[0] for k in known]), max_tokens),
            tokens=[k[0] for k in known],
            alphas=[k[1] for k in known],
            rhos=[k[2] for k in known],
        )


class _Cell(BaseModel):
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = Field(default_factory=list)
    prompt_stats: list[tuple[int, SpeculationStats]] = Field(
        default_factory=list, description="(prompt index, its row's)"
    )

    @property
    def stats(self) -> list[SpeculationStats]:
        return [s for _, s in self.prompt_stats]


class _Rotation:
    """Which engine goes first changes with every batch run, across the whole bench."""

    def __init__(self, names: list[str]):
        self.names, self.turn = names, 0

    def next(self) -> list[str]:
        shift = self.turn % len(self.names)
        self.turn += 1
        return self.names[shift:] + self.names[:shift]


def _warm_up(engines: dict[str, Scheduler], requests: list[GenerationRequest], batch: int, k_max: int) -> None:
    """Every engine once at this batch, untimed, for long enough to run its widest verify passes (the
    first pass of a new shape sets up kernels and cache blocks)."""
    short = [r.model_copy(update={"max_tokens": 2 * (k_max + 1)}) for r in _cycle(requests, batch)]
    for loop in engines.values():
        loop.generate(short)


def _cycle(requests: list[GenerationRequest], rows: int) -> list[GenerationRequest]:
    return [requests[i % len(requests)] for i in range(rows)]


def _measure_cell(
    engines: dict[str, Scheduler],
    requests: list[GenerationRequest],
    batch: int,
    order: _Rotation,
    k_max: int,
    repeats: int = 1,
) -> dict[str, _Cell]:
    """Rows cycle the prompts up to a whole number of batches; each batch runs every engine back to
    back `repeats` times, rotating the order so drift on a noisy machine hits all of them alike, and
    each engine's fastest run counts (greedy: every run decodes the same tokens; a slow spell of the
    machine spoils one run, not the figure). Every engine's window ends where a row no longer has
    room for `k_max` drafts (`_full_batch`)."""
    cycled = _cycle(requests, batch * math.ceil(len(requests) / batch))
    cells = {name: _Cell() for name in engines}
    for start in range(0, len(cycled), batch):
        chunk = cycled[start : start + batch]
        runs: dict[str, list[tuple[int, float, list[list[int]], list[SpeculationStats | None]]]] = {}
        for _ in range(repeats):
            for name in order.next():
                runs.setdefault(name, []).append(_full_batch(engines[name], chunk, k_max))
        for name, tries in runs.items():
            cell = cells[name]
            tokens, seconds, outputs, stats = max(tries, key=lambda run: run[0] / run[1])
            cell.tokens += tokens
            cell.seconds += seconds
            cell.outputs += outputs
            for row, row_stats in enumerate(stats):
                if row_stats is not None:
                    cell.prompt_stats.append(((start + row) % len(requests), row_stats))
    return cells


def _full_batch(
    loop: Scheduler, requests: list[GenerationRequest], k_max: int
) -> tuple[int, float, list[list[int]], list[SpeculationStats | None]]:
    """Decoding with every row in every pass at full draft length, as the cost model assumes (a
    serving loop refills the batch as requests finish): the first step prefills every row and
    decodes once, then the loop steps while every row has room for a whole step of `k_max` drafts
    and their bonus token, and those steps' tokens and seconds are what counts; the rows are
    cancelled there. Running on, rows near their max_tokens draft fewer tokens (a step never
    drafts past it): in a copy-heavy cell a handful of steps make up the whole window, and one
    such short step took 10-20% off its rate; and a static batch's last steps run the rows that
    drew fewer accepted tokens nearly alone. Returns (tokens, seconds, each row's tokens so far,
    each row's speculation statistics)."""
    if loop.costs is not None:  # probes run before the clock starts
        loop.costs.ensure(len(requests))
    rows = [loop.submit(r) for r in requests]
    loop.step()
    if not all(r.prefilled for r in rows):
        raise ProfileError(f"the step loop did not prefill all {len(rows)} rows in one step")
    before = sum(len(r.state.token_ids) for r in rows)
    started = time.perf_counter()
    while min(r.state.request.max_tokens - len(r.state.token_ids) for r in rows) > k_max:
        loop.step()
    seconds = time.perf_counter() - started
    tokens = sum(len(r.state.token_ids) for r in rows) - before
    outputs = [list(r.state.token_ids) for r in rows]
    stats = [r.state.speculation.model_copy() if r.state.speculation is not None else None for r in rows]
    for row in rows:
        loop.cancel(row)
    while not loop.idle:
        loop.step()
    return tokens, seconds, outputs, stats


def _same_tokens(a: list[list[int]], b: list[list[int]]) -> bool:
    """Row by row, the tokens both produced agree (a row cut early is a prefix of the other's)."""
    return len(a) == len(b) and all(
        x[: min(len(x), len(y))] == y[: min(len(x), len(y))] for x, y in zip(a, b, strict=True)
    )


def _fit_points(
    category: str,
    batch: int,
    config: ModelFitConfig,
    cells: dict[str, _Cell],
    profile: Profile,
    drafter: str,
    outlook: _Outlook,
) -> list[FitPoint]:
    measured_profile = profile.acceptance_for(category, drafter)
    alpha_profile, rho_profile = measured_profile.alpha, measured_profile.proposal_rate
    n = len(outlook.alphas)

    def predict(k: int, alphas: Sequence[float], rhos: Sequence[float]) -> float:
        return _predict_cell(profile, drafter, k, batch, alphas, rhos, outlook.tokens, config.max_tokens)

    plain = cells[PLAIN]
    plain_rate = plain.tokens / plain.seconds
    points = []
    for k in config.ks:
        cell = cells[f"k={k}"]
        run = SpeculationStats.combined(cell.stats)
        per_prompt = [SpeculationStats.combined([s for i, s in cell.prompt_stats if i == p]) for p in range(n)]
        rate = cell.tokens / cell.seconds
        points.append(
            FitPoint(
                category=category,
                batch=batch,
                k=k,
                alpha=run.alpha,
                proposal_rate=run.proposal_rate,
                alpha_profile=alpha_profile,
                proposal_rate_profile=rho_profile,
                plain_tokens_per_s=plain_rate,
                spec_tokens_per_s=rate,
                measured=rate / plain_rate,
                predicted=predict(k, [s.alpha for s in per_prompt], [s.proposal_rate for s in per_prompt]),
                predicted_profile=predict(k, [alpha_profile] * n, [rho_profile] * n),
                alpha_predicted=_mean(outlook.alphas),
                proposal_rate_predicted=_mean(outlook.rhos),
                predicted_prompt=predict(k, outlook.alphas, outlook.rhos),
                context=outlook.context,
                identical=_same_tokens(cell.outputs, plain.outputs),
                tokens=cell.tokens,
                plain_seconds=plain.seconds,
                spec_seconds=cell.seconds,
            )
        )
    return points


def _predict_cell(
    profile: Profile,
    drafter: str,
    k: int,
    batch: int,
    alphas: Sequence[float],
    rhos: Sequence[float],
    prompt_tokens: Sequence[int],
    max_tokens: int,
) -> float:
    """The cost model's speedup for a cell, batch by batch as `_measure_cell` runs them (rows cycle
    the prompts), from each prompt's α and ρ: a batch's step emits its rows' mean 1 + ρ·(E(α, k) − 1)
    tokens and runs the wide pass unless none of its distinct prompts proposed (greedy copies of a
    prompt propose together), every pass read at the batch's decode context; the cell's speedup is
    the batches' harmonic mean (each takes about as long with plain decoding)."""
    d = profile.drafter(drafter)
    n = len(alphas)
    rows = batch * math.ceil(n / batch)
    inverse = []
    for start in range(0, rows, batch):
        chunk = [(start + j) % n for j in range(batch)]
        context = decode_context(_mean([prompt_tokens[p] for p in chunk]), max_tokens)
        costs = ProfileCosts(profile, context)
        c, verify = costs.draft_cost(d, batch), costs.verify_costs(batch)
        tokens = _mean([tokens_per_step(alphas[p], k, rhos[p]) for p in chunk])
        silent = math.prod(1.0 - min(max(rhos[p], 0.0), 1.0) for p in set(chunk))
        cost = k * c + (1.0 - silent) * verify[k] + silent * verify[0]
        inverse.append(cost / tokens)
    return len(inverse) / sum(inverse)


def _served_point(category: str, batch: int, cells: dict[str, _Cell]) -> ServedPoint:
    plain, cell = cells[PLAIN], cells[SERVED]
    run = SpeculationStats.combined(cell.stats)
    rate = cell.tokens / cell.seconds
    return ServedPoint(
        category=category,
        batch=batch,
        tokens_per_s=rate,
        measured=rate / (plain.tokens / plain.seconds),
        alpha=run.alpha,
        proposal_rate=run.proposal_rate,
        mean_k=_mean(run.k_history) if run.k_history else 0.0,
        identical=_same_tokens(cell.outputs, plain.outputs),
    )


def _backend_routing(
    served: ServedPoint,
    cells: dict[str, _Cell],
    outlook: _Outlook,
    profile: Profile,
    drafter: str,
    config: ModelFitConfig,
) -> BackendRouting:
    """Where the policy sends the cell's requests from each prediction of α and ρ (the mean over the
    cell's prompts; "run": what the fixed-k engines measured), against the backend measured faster.
    A served backend that verified no draft in the cell ran plain decoding's very passes: what its
    time differs by is noise, and either backend is right."""
    measured = {SPECULATIVE: served.measured if served.mean_k > 0 else 1.0, PLAIN: 1.0}
    best = max(measured, key=lambda backend: (measured[backend], backend == PLAIN))
    run = SpeculationStats.combined([s for name, cell in cells.items() if name.startswith("k=") for s in cell.stats])
    category = profile.acceptance_for(outlook.category, drafter)
    predictions = {
        "predicted": (_mean(outlook.alphas), _mean(outlook.rhos)),
        "profile": (category.alpha, category.proposal_rate),
        "run": (run.alpha, run.proposal_rate),
    }
    chosen = {
        source: _policy_backend(profile, config, served.batch, outlook, *predictions[source])
        for source in ALPHA_SOURCES
    }
    return BackendRouting(
        category=served.category,
        batch=served.batch,
        served=served.measured,
        best=best,
        chosen=chosen,
        loss={source: 1.0 - measured[backend] / measured[best] for source, backend in chosen.items()},
    )


def _policy_backend(
    profile: Profile, config: ModelFitConfig, batch: int, outlook: _Outlook, alpha: float, rho: float
) -> str:
    """The backend `decide()` picks at this concurrency with this α and ρ, the default policy
    choosing between this drafter and plain decoding (quantization is not what the cell measures)."""
    policy = parse_policy(
        {
            "concurrency_override": batch,
            "speculation": {"drafters": [config.drafter]},
            "quantization": {"enabled": False},
        }
    )
    features = RequestFeatures(
        prompt_tokens=round(_mean(outlook.tokens)),
        max_tokens=config.max_tokens,
        category=outlook.category,
        alphas={config.drafter: AlphaInput(alpha=alpha, source="bench model-fit", proposal_rate=rho)},
    )
    return decide(features, LoadSnapshot(), profile, policy).backend


def _score_predictor(
    loaded: LoadedModel,
    drafter: Drafter,
    profile: Profile,
    prompt_set: PromptSet,
    categories: list[str],
    predictors: _Predictors,
    config: ModelFitConfig,
    progress: bool,
) -> list[PromptFit]:
    """Each category's prompts as one greedy batch at the profile's k, answering as long as the
    profile's training samples did, then again twice as long (greedy: the same first half): each
    prompt's α and ρ over the first half, what was predicted for it, and its second half's. Also
    predicted online: by a copy of the predictors that, as the router after each finished request,
    has been told what every prompt scored before it achieved."""
    if config.predictor_prompts == 0:
        return []
    k, tokens = _profile_setting(profile, "acceptance_k"), _profile_setting(profile, "max_tokens")
    engine = SpeculativeEngine(loaded, drafter.fresh(), k=k)
    online = copy.deepcopy(predictors)
    fits = []
    for category in tqdm(categories, desc="predictor", unit="category", disable=not progress):
        prompts = prompt_set.categories[category].prompts[: config.predictor_prompts]
        halves = [
            engine.generate([GenerationRequest(messages=p.messages, max_tokens=n) for p in prompts])
            for n in (tokens, 2 * tokens)
        ]
        measured = profile.acceptance_for(category, drafter.name)
        for prompt, first, whole in zip(prompts, *halves, strict=True):
            request = GenerationRequest(messages=prompt.messages, max_tokens=tokens)
            predicted = predictors.predict(request, first.prompt_tokens, drafter.name, category)
            learned = online.predict(request, first.prompt_tokens, drafter.name, category)
            assert first.speculation is not None  # the speculative engine always attaches its statistics
            online.observe(request, first.prompt_tokens, drafter.name, category, first.speculation)
            fits.append(_prompt_fit(category, prompt.id, first, whole, predicted, measured, learned))
    return fits


def _profile_setting(profile: Profile, name: str) -> int:
    """An acceptance setting the profile was measured with (a profile that does not say: the default)."""
    return int(profile.settings.get(name, ProfileConfig.model_fields[name].default))  # type: ignore[call-overload]


def _prompt_fit(
    category: str,
    prompt_id: str,
    first: GenerationResult,
    whole: GenerationResult,
    predicted: tuple[float, float],
    measured: AcceptanceProfile,
    online: tuple[float, float],
) -> PromptFit:
    """A prompt's α and ρ over its answer's first half (`first`, the shorter run) and the rest of
    `whole` (counters beyond the first; a step that straddles the halves can make a difference
    fall outside its counts, so each is clipped to them), beside the predicted (α, ρ), the
    profile's for the category and the (α, ρ) predicted online."""
    a, b = first.speculation, whole.speculation
    assert a is not None and b is not None  # the speculative engine always attaches its statistics
    judged = max(b.judged_tokens - a.judged_tokens, 0)
    requested = max(b.requested_steps - a.requested_steps, 0)
    accepted = min(max(b.accepted_tokens - a.accepted_tokens, 0), judged)
    drafts = min(max(b.drafts - a.drafts, 0), requested)
    return PromptFit(
        category=category,
        prompt_id=prompt_id,
        prompt_tokens=first.prompt_tokens,
        alpha=a.alpha,
        proposal_rate=a.proposal_rate,
        judged_tokens=a.judged_tokens,
        requested_steps=a.requested_steps,
        alpha_rest=accepted / judged if judged else 0.0,
        proposal_rate_rest=drafts / requested if requested else 0.0,
        judged_tokens_rest=judged,
        requested_steps_rest=requested,
        alpha_predicted=predicted[0],
        proposal_rate_predicted=predicted[1],
        alpha_category=measured.alpha,
        proposal_rate_category=measured.proposal_rate,
        alpha_online=online[0],
        proposal_rate_online=online[1],
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _report(
    config: ModelFitConfig,
    model: dict[str, object],
    profile: Profile,
    points: list[FitPoint],
    prompts: list[PromptFit],
    served: list[ServedPoint],
    backend_routing: list[BackendRouting],
) -> ModelFitReport:
    categories = list(dict.fromkeys(p.category for p in points))
    return ModelFitReport(
        machine=machine_info(),
        model=model,
        config=config,
        profile_created=f"{profile.created:%Y-%m-%d %H:%M} UTC",
        points=points,
        mape=_mape([p.predicted for p in points], [p.measured for p in points]),
        mape_profile_alpha=_mape([p.predicted_profile for p in points], [p.measured for p in points]),
        mape_predicted=_mape_predicted(points),
        break_even=[_break_even(category, points, profile, config) for category in categories],
        by_category=[_group(c, [p for p in points if p.category == c]) for c in categories],
        by_batch=[_group(f"b={b}", [p for p in points if p.batch == b]) for b in config.batches],
        prompts=prompts,
        predictor=_predictor_fit(prompts, profile, config.drafter),
        routing=[
            _routing(c, b, [p for p in points if p.category == c and p.batch == b])
            for c in categories
            for b in config.batches
        ],
        served=served,
        backend_routing=backend_routing,
    )


def _mape(predicted: list[float], measured: list[float]) -> float:
    return 100.0 * sum(abs(p - m) / m for p, m in zip(predicted, measured, strict=True)) / len(measured)


def _mape_predicted(points: list[FitPoint]) -> float | None:
    if any(p.predicted_prompt is None for p in points):
        return None
    return _mape([float(p.predicted_prompt or 0.0) for p in points], [p.measured for p in points])


def _group(name: str, points: list[FitPoint]) -> ErrorGroup:
    return ErrorGroup(
        name=name,
        cells=len(points),
        mape=_mape([p.predicted for p in points], [p.measured for p in points]),
        mape_profile_alpha=_mape([p.predicted_profile for p in points], [p.measured for p in points]),
        mape_predicted=_mape_predicted(points),
    )


def _predictor_fit(prompts: list[PromptFit], profile: Profile, drafter: str) -> list[PredictorFit]:
    """The predictor's error per prompt with evidence (α: judged tokens; ρ: steps that asked),
    beside the profile's category mean, its mean over every category (a constant), and the
    answer's second half against its first (prompts with evidence in both)."""
    name = profile.drafter(drafter).name
    rows = [a for a in profile.acceptance if a.drafter == name]
    constants = {
        "alpha": sum(a.accepted_tokens for a in rows) / max(sum(a.judged_tokens for a in rows), 1),
        "proposal_rate": profile.proposal_rate(drafter),
    }
    fits = []
    for target, constant in constants.items():
        evidence = [p for p in prompts if _evidence(p, target)]
        if not evidence:
            continue
        errors = {
            "predictor": [abs(getattr(p, f"{target}_predicted") - getattr(p, target)) for p in evidence],
            "online": [abs(getattr(p, f"{target}_online") - getattr(p, target)) for p in evidence],
            "category": [abs(getattr(p, f"{target}_category") - getattr(p, target)) for p in evidence],
            "constant": [abs(constant - getattr(p, target)) for p in evidence],
        }
        weights = [_evidence(p, target) for p in evidence]
        both = [p for p in evidence if _evidence(p, target, rest=True)]
        halves = [abs(getattr(p, f"{target}_rest") - getattr(p, target)) for p in both]
        halves_weights = [min(_evidence(p, target), _evidence(p, target, rest=True)) for p in both]
        fits.append(
            PredictorFit(
                target=target,
                prompts=len(evidence),
                **{f"mae_{name}": _mean(e) for name, e in errors.items()},
                **{f"weighted_mae_{name}": _weighted_mean(e, weights) for name, e in errors.items()},
                halves_prompts=len(both),
                mae_halves=_mean(halves) if both else None,
                weighted_mae_halves=_weighted_mean(halves, halves_weights) if both else None,
            )
        )
    return fits


def _evidence(prompt: PromptFit, target: str, rest: bool = False) -> int:
    """What a prompt's measured α (judged tokens) or ρ (steps that asked) rests on, in its
    answer's first half or (`rest`) its second."""
    if target == "alpha":
        return prompt.judged_tokens_rest if rest else prompt.judged_tokens
    return prompt.requested_steps_rest if rest else prompt.requested_steps


def _weighted_mean(values: Sequence[float], weights: Sequence[int]) -> float:
    return sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)


def _routing(category: str, batch: int, points: list[FitPoint]) -> RoutingCheck:
    """Which option each prediction would pick in this cell, and how much slower that measured than the best."""
    measured = {PLAIN: 1.0, **{f"k={p.k}": p.measured for p in points}}
    best = max(measured, key=lambda name: measured[name])

    def chosen(value: Callable[[FitPoint], float | None]) -> str:
        options = {PLAIN: 1.0, **{f"k={p.k}": float(value(p) or 0.0) for p in points}}
        return max(options, key=lambda name: (options[name], name == PLAIN))

    picks = {
        "predicted": chosen(lambda p: p.predicted_prompt),
        "profile": chosen(lambda p: p.predicted_profile),
        "run": chosen(lambda p: p.predicted),
    }
    losses = {which: 1.0 - measured[pick] / measured[best] for which, pick in picks.items()}
    return RoutingCheck(
        category=category,
        batch=batch,
        best=best,
        chosen_predicted=picks["predicted"],
        chosen_profile=picks["profile"],
        chosen_run=picks["run"],
        loss_predicted=losses["predicted"],
        loss_profile=losses["profile"],
        loss_run=losses["run"],
    )


def _break_even(category: str, points: list[FitPoint], profile: Profile, config: ModelFitConfig) -> BreakEven:
    mine = [p for p in points if p.category == category]

    def first_losing(value: Callable[[FitPoint], float | None]) -> int | None:
        for b in config.batches:
            if max(float(value(p) or 0.0) for p in mine if p.batch == b) < 1.0:
                return b
        return None

    context = _mean(
        [p.context for p in mine if p.context is not None] or [float(profile.settings.get("context_tokens", 192))]
    )  # type: ignore[arg-type]
    costs = ProfileCosts(profile, context)
    d = profile.drafter(config.drafter)
    alpha, rho = mine[0].alpha_profile, mine[0].proposal_rate_profile

    def best(b: int) -> float:
        verify = costs.verify_costs(b)
        return max(speedup(alpha, k, costs.draft_cost(d, b), verify[k], rho, b, verify[0]) for k in config.ks)

    measured = first_losing(lambda p: p.measured)
    predicted = first_losing(lambda p: p.predicted)
    predicted_prompt = first_losing(lambda p: p.predicted_prompt) if mine[0].predicted_prompt is not None else None
    return BreakEven(
        category=category,
        measured=measured,
        predicted=predicted,
        predicted_scan=break_even_concurrency(best, b_max=max(config.batches) * 4),
        predicted_prompt=predicted_prompt,
        steps_off=_steps(config.batches, measured, predicted),
        steps_off_prompt=_steps(config.batches, measured, predicted_prompt)
        if mine[0].predicted_prompt is not None
        else None,
    )


def _steps(grid: list[int], a: int | None, b: int | None) -> int:
    """Grid steps between two break-evens (None: past the grid's last batch, one step beyond it)."""

    def index(value: int | None) -> int:
        return len(grid) if value is None else grid.index(value)

    return abs(index(a) - index(b))


def render_model_fit(report: ModelFitReport) -> str:
    c = report.config
    lines = [
        f"specroute bench model-fit — {report.model['name']} ({report.model['dtype']}) on {report.machine.cpu}, "
        f"{report.machine.torch_threads} threads; drafter {c.drafter}, greedy, {c.max_tokens} tokens per row, "
        f"{c.prompts_per_category} {c.prompt_set} prompts per category; profile of {report.profile_created}",
        "",
        f"  {'category':14} {'b':>3} {'k':>2} {'ctx':>5} {'α run':>6} {'ρ run':>5} {'α prof':>6} {'α pred':>6} "
        f"{'plain t/s':>9} {'spec t/s':>8} {'measured':>8} {'predicted':>9} {'error':>7} {'pred(α prof)':>12} "
        f"{'pred(α pred)':>12}  same",
    ]
    for p in report.points:
        lines.append(
            f"  {p.category:14} {p.batch:>3} {p.k:>2} {_number(p.context, 5, 0)} {p.alpha:6.2f} {p.proposal_rate:5.2f} "
            f"{p.alpha_profile:6.2f} {_number(p.alpha_predicted, 6, 2)} {p.plain_tokens_per_s:9.1f} "
            f"{p.spec_tokens_per_s:8.1f} {p.measured:7.2f}× {p.predicted:8.2f}× {p.error:+7.1%} "
            f"{p.predicted_profile:11.2f}× {_number(p.predicted_prompt, 11, 2)}×  {'yes' if p.identical else 'NO'}"
        )
    predicted = "" if report.mape_predicted is None else f", {report.mape_predicted:.1f}% (from the predictor's α)"
    lines += [
        "",
        f"mean absolute percentage error: {report.mape:.1f}% (prediction from the run's α), "
        f"{report.mape_profile_alpha:.1f}% (from the profile's α per category){predicted}",
    ]
    if report.by_category:
        lines += ["", *_groups("per category", report.by_category), "", *_groups("per batch", report.by_batch)]
    lines += [
        "",
        "break-even concurrency (smallest batch where no k beats plain decoding; steps: grid steps off the measured):",
        f"  {'category':14} {'measured':>9} {'predicted':>9} {'steps':>5} {'pred(α pred)':>12} {'steps':>5} "
        f"{'profile scan':>12}",
    ]
    top = max(c.batches)
    for be in report.break_even:
        lines.append(
            f"  {be.category:14} {_batch(be.measured, top):>9} {_batch(be.predicted, top):>9} "
            f"{_number(be.steps_off, 5, 0)} {_batch(be.predicted_prompt, top):>12} "
            f"{_number(be.steps_off_prompt, 5, 0)} "
            f"{_batch(be.predicted_scan, top * 4):>12}"
        )
    if report.predictor:
        lines += ["", *_predictor_lines(report)]
    if report.served:
        lines += ["", *_served_lines(report)]
    if report.routing:
        lines += ["", *_routing_lines(report)]
    return "\n".join(lines)


def _predictor_lines(report: ModelFitReport) -> list[str]:
    c = report.config
    per_category = "all" if c.predictor_prompts is None else f"{c.predictor_prompts} per category of the"
    lines = [
        f"per-prompt predictor ({per_category} {c.prompt_set} prompts, greedy at the profile's k, each answer's first "
        "half as long as the profile's answers), mean absolute error:",
        "(online: predicted after the prompts before it fed back what they achieved, as the router learns; halves: "
        "the answer's second half against its first, what no prediction before decoding can be expected to beat; "
        "weighted: each prompt by its evidence, judged tokens for α and steps that asked for ρ)",
        f"  {'':12} {'prompts':>7} {'predictor':>9} {'online':>6} {'category mean':>13} {'constant':>8} {'halves':>6}",
    ]
    for weighted in (False, True):
        for f in report.predictor:
            name = ("α" if f.target == "alpha" else "ρ") + (" weighted" if weighted else "")
            w = "weighted_" if weighted else ""
            predictor, online, category, constant, halves = (
                getattr(f, f"{w}mae_{of}") for of in ("predictor", "online", "category", "constant", "halves")
            )
            lines.append(
                f"  {name:12} {f.prompts:>7} {predictor:9.3f} {online:6.3f} {category:13.3f} {constant:8.3f} "
                f"{_number(halves, 6, 3)}"
            )
    return lines


def _served_lines(report: ModelFitReport) -> list[str]:
    lines = [
        "the speculative backend as served (k chosen per step), measured beside the same plain runs:",
        f"  {'category':14} {'b':>3} {'spec t/s':>8} {'measured':>8} {'mean k':>6} {'α':>5} {'ρ':>5}  same",
    ]
    for p in report.served:
        lines.append(
            f"  {p.category:14} {p.batch:>3} {p.tokens_per_s:8.1f} {p.measured:7.2f}× {p.mean_k:6.2f} "
            f"{p.alpha:5.2f} {p.proposal_rate:5.2f}  {'yes' if p.identical else 'NO'}"
        )
    return lines


def _groups(title: str, groups: list[ErrorGroup]) -> list[str]:
    lines = [
        f"mean absolute percentage error {title}:",
        f"  {'':14} {'cells':>5} {'run α':>7} {'profile α':>9} {'predicted α':>11}",
    ]
    for g in groups:
        lines.append(
            f"  {g.name:14} {g.cells:>5} {g.mape:6.1f}% {g.mape_profile_alpha:8.1f}% "
            f"{_number(g.mape_predicted, 10, 1)}%"
        )
    return lines


def _routing_lines(report: ModelFitReport) -> list[str]:
    lines = []
    if report.backend_routing:
        lines += [
            f"routing on a prediction to a backend (the policy's decide(): speculative, as served, or plain) in "
            f"{len(report.backend_routing)} cells: wrong (measured ≥ {WRONG_IF_SLOWER:.0%} slower than the other) in "
            f"{report.wrong_backend_share('predicted'):.1%} with the predictor's α, "
            f"{report.wrong_backend_share('profile'):.1%} with the profile's, {report.wrong_backend_share('run'):.1%} "
            "with the run's",
        ]
        for b in report.backend_routing:
            if max(b.loss.values()) >= WRONG_IF_SLOWER:
                lines.append(
                    f"  {b.category:14} b={b.batch:<3} served speculation {b.served:.2f}× plain: "
                    + ", ".join(
                        f"{SOURCE_NAMES[source]} α chose {b.chosen[source]} ({b.loss[source]:.0%} slower)"
                        for source in ALPHA_SOURCES
                    )
                )
    lines.append(
        f"choosing k too (plain or speculation at the k predicted best) in {len(report.routing)} cells: wrong "
        f"(measured ≥ {WRONG_IF_SLOWER:.0%} slower than the fastest option) in "
        f"{report.wrong_share('predicted'):.1%} with the predictor's α, {report.wrong_share('profile'):.1%} with "
        f"the profile's, {report.wrong_share('run'):.1%} with the run's"
    )
    for r in report.routing:
        if max(r.loss_predicted, r.loss_profile, r.loss_run) >= WRONG_IF_SLOWER:
            lines.append(
                f"  {r.category:14} b={r.batch:<3} fastest {r.best:5}: predictor's α chose {r.chosen_predicted} "
                f"({r.loss_predicted:.0%} slower), profile's {r.chosen_profile} ({r.loss_profile:.0%}), "
                f"run's {r.chosen_run} ({r.loss_run:.0%})"
            )
    return lines


def _number(value: float | None, width: int, digits: int) -> str:
    return f"{'—':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def _batch(value: int | None, top: int) -> str:
    return f"> {top}" if value is None else str(value)
