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
concurrency in grid steps; per prompt, the predictor's α and ρ against what the prompt achieved
(beside the category mean and a constant); and the share of cells where routing on a prediction
(plain, or speculation at the k predicted best) would have picked an option measured ≥ 5% slower
than the fastest one.

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

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from tqdm import tqdm

from backends.generation import GenerationRequest
from backends.models import load_model
from backends.plain import PlainEngine
from backends.scheduler import LoopSettings, Scheduler, seeded_step_costs
from backends.speculative.engine import SpeculativeEngine
from backends.speculative.factory import build_drafter
from backends.speculative.stats import SpeculationStats
from policies.cost_model import break_even_concurrency, speedup, tokens_per_step
from policies.drafters import KINDS, DrafterConfig, DrafterKind
from policies.estimates import ProfileCosts, decode_context
from policies.profile import Profile, ProfileError

from .hardware import MachineInfo, machine_info
from .predictor import AlphaPredictor
from .profiling import default_profile_path
from .settings import ModelSettings
from .workloads import PromptSetName, WorkloadPrompt, check_categories, load_prompt_set

PLAIN = "plain"
MAX_STEP_TOKENS = 65536  # the step loop's largest step: every row's whole prompt at once
WRONG_IF_SLOWER = 0.05  # a routing choice is wrong when what it picked measured this much slower than the best


class ModelFitConfig(ModelSettings):
    profile: str | None = Field(None, description="profile path (default: this model's under SPECROUTE_HOME)")
    drafter: DrafterKind = KINDS[0]
    drafter_options: DrafterConfig = Field(default_factory=DrafterConfig)
    categories: list[str] | None = None
    ks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    batches: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1)
    max_tokens: int = Field(40, ge=4, le=1024)
    prompts_per_category: int = Field(2, ge=1)
    repeats: int = Field(
        2, ge=1, le=10, description="runs of every engine per batch, the fastest kept (as the profile keeps its best)"
    )
    prompt_set: PromptSetName = Field(
        "heldout", description="which prompt set the cells run ('heldout': none of it tuned the profile or predictor)"
    )

    _known_categories = field_validator("categories")(check_categories)

    @field_validator("ks", "batches")
    @classmethod
    def _increasing(cls, values: list[int]) -> list[int]:
        if values != sorted(set(values)) or values[0] < 1:
            raise ValueError(f"must be positive and strictly increasing (got {values})")
        return values


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
    """One prompt: the α and ρ it achieved over every cell it ran in, and what was predicted."""

    category: str
    prompt_id: str
    prompt_tokens: int
    alpha: float
    proposal_rate: float
    judged_tokens: int
    requested_steps: int = Field(description="steps that asked the drafter for tokens (the evidence behind ρ)")
    alpha_predicted: float
    proposal_rate_predicted: float
    alpha_category: float = Field(description="the profile's α for the category")
    proposal_rate_category: float


class PredictorFit(BaseModel):
    """Mean absolute error over the prompts: the predictor, the profile's category mean, a constant;
    each also weighted by the prompt's evidence (α: judged tokens, ρ: steps that asked), which is
    how much of the decoding each prompt's error steers."""

    target: str
    prompts: int
    mae_predictor: float
    mae_category: float
    mae_constant: float
    weighted_mae_predictor: float
    weighted_mae_category: float
    weighted_mae_constant: float


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

    def wrong_share(self, which: Literal["predicted", "profile", "run"]) -> float:
        """Share of cells whose choice measured ≥ WRONG_IF_SLOWER slower than the best option."""
        losses = [getattr(r, f"loss_{which}") for r in self.routing]
        return sum(loss >= WRONG_IF_SLOWER for loss in losses) / max(len(losses), 1)


def run_model_fit(config: ModelFitConfig, progress: bool = True) -> ModelFitReport:
    path = Path(config.profile) if config.profile else default_profile_path(config.model, config.dtype, config.device)
    profile = Profile.load(path)
    loaded = load_model(config.model, dtype=config.dtype, device=config.device, threads=config.threads)
    if profile.model.name != loaded.info.name or profile.model.dtype != loaded.info.dtype:
        raise ProfileError(f"{path} profiles {profile.model.name} ({profile.model.dtype}), not this model")
    # Every row is prefilled in the first step, so the first token ends the shared prefill for every
    # row of both engines and what is timed after it is decoding alone.
    loop = LoopSettings(max_batch=max(config.batches), max_step_tokens=MAX_STEP_TOKENS, prefill_chunk=MAX_STEP_TOKENS)
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
    # The plain side is the step loop the plain backend serves with: the same paged cache and passes.
    engines: dict[str, Scheduler] = {PLAIN: Scheduler(loaded, loop)}
    for k in config.ks:
        engines[f"k={k}"] = SpeculativeEngine(loaded, drafter.fresh(), k=k, costs=costs, settings=loop)
    grid = [(c, b) for c in categories for b in config.batches]
    points, order, seen = [], _Rotation(list(engines)), _Seen()
    warmed: set[int] = set()
    for category, batch in tqdm(grid, desc="model fit", unit="cell", disable=not progress):
        prompts = prompt_set.categories[category].prompts[: config.prompts_per_category]
        requests = [
            GenerationRequest(messages=p.messages, max_tokens=config.max_tokens, ignore_eos=True) for p in prompts
        ]
        if batch not in warmed:
            _warm_up(engines, requests, batch)
            warmed.add(batch)
        measured = _measure_cell(engines, requests, batch, order, config.repeats)
        outlook = seen.outlook(category, prompts, requests, plain, predictors, drafter.name, config.max_tokens)
        seen.add(category, measured)
        points += _fit_points(category, batch, config, measured, profile, drafter.name, outlook)
    return _report(config, loaded.info.as_dict(), profile, points, seen.fits(profile, drafter.name))


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


class _Outlook(BaseModel):
    """What is known about a cell's prompts before it runs."""

    context: float
    tokens: list[int] = Field(description="each prompt's length in tokens")
    alphas: list[float]
    rhos: list[float]


class _Seen:
    """Per prompt, across the whole bench: its length, predictions and the speculation it achieved."""

    def __init__(self) -> None:
        self.prompts: dict[str, tuple[str, int, float, float]] = {}  # category, tokens, α, ρ
        self.stats: dict[str, list[SpeculationStats]] = {}
        self._ids: dict[str, list[str]] = {}

    def outlook(
        self,
        category: str,
        prompts: Sequence[WorkloadPrompt],
        requests: Sequence[GenerationRequest],
        plain: PlainEngine,
        predictors: _Predictors,
        drafter: str,
        max_tokens: int,
    ) -> _Outlook:
        self._ids[category] = [p.id for p in prompts]
        for prompt, request in zip(prompts, requests, strict=True):
            if prompt.id not in self.prompts:
                tokens = len(plain.encode(request))
                alpha, rho = predictors.predict(request, tokens, drafter, category)
                self.prompts[prompt.id] = (category, tokens, alpha, rho)
        known = [self.prompts[p.id] for p in prompts]
        return _Outlook(
            context=decode_context(sum(k[1] for k in known) / len(known), max_tokens),
            tokens=[k[1] for k in known],
            alphas=[k[2] for k in known],
            rhos=[k[3] for k in known],
        )

    def add(self, category: str, cells: dict[str, _Cell]) -> None:
        ids = self._ids[category]
        for name, cell in cells.items():
            if name != PLAIN:
                for index, stats in cell.prompt_stats:
                    self.stats.setdefault(ids[index], []).append(stats)

    def fits(self, profile: Profile, drafter: str) -> list[PromptFit]:
        fits = []
        for prompt_id, (category, tokens, alpha, rho) in self.prompts.items():
            if prompt_id not in self.stats:
                continue
            run = SpeculationStats.combined(self.stats[prompt_id])
            measured = profile.acceptance_for(category, drafter)
            fits.append(
                PromptFit(
                    category=category,
                    prompt_id=prompt_id,
                    prompt_tokens=tokens,
                    alpha=run.alpha,
                    proposal_rate=run.proposal_rate,
                    judged_tokens=run.judged_tokens,
                    requested_steps=run.requested_steps,
                    alpha_predicted=alpha,
                    proposal_rate_predicted=rho,
                    alpha_category=measured.alpha,
                    proposal_rate_category=measured.proposal_rate,
                )
            )
        return fits


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


def _warm_up(engines: dict[str, Scheduler], requests: list[GenerationRequest], batch: int) -> None:
    short = [r.model_copy(update={"max_tokens": 4}) for r in _cycle(requests, batch)]
    for loop in engines.values():
        loop.generate(short)


def _cycle(requests: list[GenerationRequest], rows: int) -> list[GenerationRequest]:
    return [requests[i % len(requests)] for i in range(rows)]


def _measure_cell(
    engines: dict[str, Scheduler], requests: list[GenerationRequest], batch: int, order: _Rotation, repeats: int = 1
) -> dict[str, _Cell]:
    """Rows cycle the prompts up to a whole number of batches; each batch runs every engine back to
    back `repeats` times, rotating the order so drift on a noisy machine hits all of them alike, and
    each engine's fastest run counts (greedy: every run decodes the same tokens; a slow spell of the
    machine spoils one run, not the figure)."""
    cycled = _cycle(requests, batch * math.ceil(len(requests) / batch))
    cells = {name: _Cell() for name in engines}
    for start in range(0, len(cycled), batch):
        chunk = cycled[start : start + batch]
        runs: dict[str, list[tuple[int, float, list[list[int]], list[SpeculationStats | None]]]] = {}
        for _ in range(repeats):
            for name in order.next():
                runs.setdefault(name, []).append(_full_batch(engines[name], chunk))
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
    loop: Scheduler, requests: list[GenerationRequest]
) -> tuple[int, float, list[list[int]], list[SpeculationStats | None]]:
    """Decoding with every row in every pass, as the cost model assumes (a serving loop refills the
    batch as requests finish): the first step prefills every row and decodes once, then the loop
    steps until the first row has its max_tokens, and those steps' tokens and seconds are what
    counts; the other rows are cancelled there. Without the cut, a static batch's last steps run
    the rows that drew fewer accepted tokens nearly alone. Returns (tokens, seconds, each row's
    tokens so far, each row's speculation statistics)."""
    if loop.costs is not None:  # probes run before the clock starts
        loop.costs.ensure(len(requests))
    rows = [loop.submit(r) for r in requests]
    loop.step()
    if not all(r.prefilled for r in rows):
        raise ProfileError(f"the step loop did not prefill all {len(rows)} rows in one step")
    before = sum(len(r.state.token_ids) for r in rows)
    started = time.perf_counter()
    while not any(r.done for r in rows):
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


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _report(
    config: ModelFitConfig, model: dict[str, object], profile: Profile, points: list[FitPoint], prompts: list[PromptFit]
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
    beside the profile's category mean and its mean over every category (a constant)."""
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
            "category": [abs(getattr(p, f"{target}_category") - getattr(p, target)) for p in evidence],
            "constant": [abs(constant - getattr(p, target)) for p in evidence],
        }
        weights = [_evidence(p, target) for p in evidence]
        fits.append(
            PredictorFit(
                target=target,
                prompts=len(evidence),
                **{f"mae_{name}": _mean(e) for name, e in errors.items()},
                **{f"weighted_mae_{name}": _weighted_mean(e, weights) for name, e in errors.items()},
            )
        )
    return fits


def _evidence(prompt: PromptFit, target: str) -> int:
    return prompt.judged_tokens if target == "alpha" else prompt.requested_steps


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
        lines += [
            "",
            f"per-prompt predictor ({c.prompt_set} prompts, α and ρ over every cell each ran in), mean absolute error:",
            "(weighted: each prompt by its evidence, judged tokens for α and steps that asked for ρ)",
            f"  {'':14} {'prompts':>7} {'predictor':>9} {'category mean':>13} {'constant':>8} {'weighted:':>10} "
            f"{'predictor':>9} {'category mean':>13} {'constant':>8}",
        ]
        for f in report.predictor:
            name = "α" if f.target == "alpha" else "ρ"
            lines.append(
                f"  {name:14} {f.prompts:>7} {f.mae_predictor:9.3f} {f.mae_category:13.3f} {f.mae_constant:8.3f} "
                f"{'':>10} {f.weighted_mae_predictor:9.3f} {f.weighted_mae_category:13.3f} "
                f"{f.weighted_mae_constant:8.3f}"
            )
    if report.routing:
        lines += ["", *_routing_lines(report)]
    return "\n".join(lines)


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
    cells = len(report.routing)
    lines = [
        f"routing on a prediction (plain or speculation at the k predicted best) in {cells} cells: "
        f"wrong (measured ≥ {WRONG_IF_SLOWER:.0%} slower than the fastest option) in "
        f"{report.wrong_share('predicted'):.0%} with the predictor's α, {report.wrong_share('profile'):.0%} with "
        f"the profile's, {report.wrong_share('run'):.0%} with the run's",
    ]
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
