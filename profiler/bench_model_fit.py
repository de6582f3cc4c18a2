"""`specroute bench model-fit`: does the cost model predict what speculation really does?

For each category × batch b × fixed k, the speculative engine and the plain engine decode the same
prompts in the same run (every configuration of a batch back to back, rotating which goes first),
and the measured decode speedup is set against the cost model's prediction E(α, k) / (k·c + v(b, k))
with c and v from the profile. Two predictions are shown: from the α measured in that very run
(the cost model's own error) and from the profile's α for the category (what the router would have
predicted before running). Every row generates exactly max_tokens tokens (EOS ignored), so a batch
keeps its size and prefill is left out of the timing: both engines share it. Each engine first runs
once untimed at every batch size (kernel set-up for new shapes is not decoding).

A batch larger than the category's prompts repeats them; greedy copies of a prompt propose in the
very same steps, so the chance that some row drafts (which widens the shared pass) is computed over
the distinct prompts of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field, field_validator
from tqdm import tqdm

from backends.generation import GenerationRequest, GenerationResult
from backends.models import load_model
from backends.plain import PlainEngine
from backends.scheduler import seeded_step_costs
from backends.speculative.engine import SpeculativeEngine
from backends.speculative.factory import build_drafter
from backends.speculative.stats import SpeculationStats
from policies.cost_model import break_even_concurrency, speedup
from policies.drafters import KINDS, DrafterConfig, DrafterKind
from policies.estimates import ProfileCosts
from policies.profile import Profile, ProfileError

from .hardware import MachineInfo, machine_info
from .profiling import default_profile_path
from .settings import ModelSettings
from .workloads import check_categories, load_prompt_set

PLAIN = "plain"


class ModelFitConfig(ModelSettings):
    profile: str | None = Field(None, description="profile path (default: this model's under SPECROUTE_HOME)")
    drafter: DrafterKind = KINDS[0]
    drafter_options: DrafterConfig = Field(default_factory=DrafterConfig)
    categories: list[str] | None = None
    ks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    batches: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1)
    max_tokens: int = Field(40, ge=4, le=1024)
    prompts_per_category: int = Field(2, ge=1)

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
    identical: bool = Field(description="greedy tokens equal the plain engine's on every row")
    tokens: int = Field(description="decoded tokens after the first, per engine (the same for both)")
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


class ModelFitReport(BaseModel):
    machine: MachineInfo
    model: dict[str, object]
    config: ModelFitConfig
    profile_created: str
    points: list[FitPoint]
    mape: float = Field(description="mean absolute percentage error, prediction from the run's α")
    mape_profile_alpha: float
    break_even: list[BreakEven]


def run_model_fit(config: ModelFitConfig, progress: bool = True) -> ModelFitReport:
    path = Path(config.profile) if config.profile else default_profile_path(config.model, config.dtype, config.device)
    profile = Profile.load(path)
    loaded = load_model(config.model, dtype=config.dtype, device=config.device, threads=config.threads)
    if profile.model.name != loaded.info.name or profile.model.dtype != loaded.info.dtype:
        raise ProfileError(f"{path} profiles {profile.model.name} ({profile.model.dtype}), not this model")
    costs = seeded_step_costs(loaded, profile.target)
    if max(config.ks) + 1 > costs.max_width:
        raise ProfileError(f"the profile measured passes up to {costs.max_width} tokens: k ≤ {costs.max_width - 1}")
    drafter = build_drafter(config.drafter_options.of(config.drafter), loaded)
    prompt_set = load_prompt_set()
    categories = config.categories or list(prompt_set.categories)
    for category in categories:  # every prediction input must exist before anything is timed
        profile.acceptance_for(category, drafter.name)
    engines: dict[str, Callable[[list[GenerationRequest]], list[GenerationResult]]] = {
        PLAIN: PlainEngine(loaded).generate
    }
    for k in config.ks:
        engines[f"k={k}"] = SpeculativeEngine(loaded, drafter.fresh(), k=k, costs=costs).generate
    grid = [(c, b) for c in categories for b in config.batches]
    points, order = [], _Rotation(list(engines))
    warmed: set[int] = set()
    for category, batch in tqdm(grid, desc="model fit", unit="cell", disable=not progress):
        prompts = prompt_set.categories[category].prompts[: config.prompts_per_category]
        requests = [
            GenerationRequest(messages=p.messages, max_tokens=config.max_tokens, ignore_eos=True) for p in prompts
        ]
        if batch not in warmed:
            _warm_up(engines, requests, batch)
            warmed.add(batch)
        measured = _measure_cell(engines, requests, batch, order)
        points += _fit_points(category, batch, min(batch, len(prompts)), config, measured, profile, drafter.name)
    return _report(config, loaded.info.as_dict(), profile, points)


class _Cell(BaseModel):
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = Field(default_factory=list)
    stats: list[SpeculationStats] = Field(default_factory=list)


class _Rotation:
    """Which engine goes first changes with every batch run, across the whole bench."""

    def __init__(self, names: list[str]):
        self.names, self.turn = names, 0

    def next(self) -> list[str]:
        shift = self.turn % len(self.names)
        self.turn += 1
        return self.names[shift:] + self.names[:shift]


def _warm_up(
    engines: dict[str, Callable[[list[GenerationRequest]], list[GenerationResult]]],
    requests: list[GenerationRequest],
    batch: int,
) -> None:
    short = [r.model_copy(update={"max_tokens": 4}) for r in _cycle(requests, batch)]
    for run in engines.values():
        run(short)


def _cycle(requests: list[GenerationRequest], rows: int) -> list[GenerationRequest]:
    return [requests[i % len(requests)] for i in range(rows)]


def _measure_cell(
    engines: dict[str, Callable[[list[GenerationRequest]], list[GenerationResult]]],
    requests: list[GenerationRequest],
    batch: int,
    order: _Rotation,
) -> dict[str, _Cell]:
    """Rows cycle the prompts up to a whole number of batches; each batch runs every engine back to
    back, rotating the order so drift on a noisy machine hits all of them alike."""
    cycled = _cycle(requests, batch * math.ceil(len(requests) / batch))
    cells = {name: _Cell() for name in engines}
    for start in range(0, len(cycled), batch):
        chunk = cycled[start : start + batch]
        for name in order.next():
            results = engines[name](chunk)
            cell = cells[name]
            cell.tokens += sum(r.completion_tokens - 1 for r in results)
            cell.seconds += _decode_seconds(results)
            cell.outputs += [r.token_ids for r in results]
            cell.stats += [r.speculation for r in results if r.speculation is not None]
    return cells


def _decode_seconds(results: list[GenerationResult]) -> float:
    """First token (end of the shared prefill) to the last row's last token."""
    first = min(r.ttft_s for r in results)
    return max(r.ttft_s + r.tpot_s * (r.completion_tokens - 1) for r in results) - first


def _fit_points(
    category: str,
    batch: int,
    distinct: int,
    config: ModelFitConfig,
    cells: dict[str, _Cell],
    profile: Profile,
    drafter: str,
) -> list[FitPoint]:
    costs = ProfileCosts(profile)
    d = profile.drafter(drafter)
    c, verify = costs.draft_cost(d, batch), costs.verify_costs(batch)
    measured_profile = profile.acceptance_for(category, drafter)
    alpha_profile, rho_profile = measured_profile.alpha, measured_profile.proposal_rate
    plain = cells[PLAIN]
    plain_rate = plain.tokens / plain.seconds
    points = []
    for k in config.ks:
        cell = cells[f"k={k}"]
        run = SpeculationStats.combined(cell.stats)
        alpha, rho = run.alpha, run.proposal_rate
        rate = cell.tokens / cell.seconds
        points.append(
            FitPoint(
                category=category,
                batch=batch,
                k=k,
                alpha=alpha,
                proposal_rate=rho,
                alpha_profile=alpha_profile,
                proposal_rate_profile=rho_profile,
                plain_tokens_per_s=plain_rate,
                spec_tokens_per_s=rate,
                measured=rate / plain_rate,
                predicted=speedup(alpha, k, c, verify[k], rho, distinct, verify[0]),
                predicted_profile=speedup(alpha_profile, k, c, verify[k], rho_profile, distinct, verify[0]),
                identical=cell.outputs == plain.outputs,
                tokens=cell.tokens,
                plain_seconds=plain.seconds,
                spec_seconds=cell.seconds,
            )
        )
    return points


def _report(
    config: ModelFitConfig, model: dict[str, object], profile: Profile, points: list[FitPoint]
) -> ModelFitReport:
    return ModelFitReport(
        machine=machine_info(),
        model=model,
        config=config,
        profile_created=f"{profile.created:%Y-%m-%d %H:%M} UTC",
        points=points,
        mape=_mape([p.predicted for p in points], [p.measured for p in points]),
        mape_profile_alpha=_mape([p.predicted_profile for p in points], [p.measured for p in points]),
        break_even=[
            _break_even(category, points, profile, config) for category in dict.fromkeys(p.category for p in points)
        ],
    )


def _mape(predicted: list[float], measured: list[float]) -> float:
    return 100.0 * sum(abs(p - m) / m for p, m in zip(predicted, measured, strict=True)) / len(measured)


def _break_even(category: str, points: list[FitPoint], profile: Profile, config: ModelFitConfig) -> BreakEven:
    mine = [p for p in points if p.category == category]

    def first_losing(value: Callable[[FitPoint], float]) -> int | None:
        for b in config.batches:
            if max(value(p) for p in mine if p.batch == b) < 1.0:
                return b
        return None

    costs = ProfileCosts(profile)
    d = profile.drafter(config.drafter)
    alpha, rho = mine[0].alpha_profile, mine[0].proposal_rate_profile

    def best(b: int) -> float:
        verify = costs.verify_costs(b)
        return max(speedup(alpha, k, costs.draft_cost(d, b), verify[k], rho, b, verify[0]) for k in config.ks)

    return BreakEven(
        category=category,
        measured=first_losing(lambda p: p.measured),
        predicted=first_losing(lambda p: p.predicted),
        predicted_scan=break_even_concurrency(best, b_max=max(config.batches) * 4),
    )


def render_model_fit(report: ModelFitReport) -> str:
    c = report.config
    lines = [
        f"specroute bench model-fit — {report.model['name']} ({report.model['dtype']}) on {report.machine.cpu}, "
        f"{report.machine.torch_threads} threads; drafter {c.drafter}, greedy, {c.max_tokens} tokens per row, "
        f"{c.prompts_per_category} prompts per category; profile of {report.profile_created}",
        "",
        f"  {'category':14} {'b':>3} {'k':>2} {'α run':>6} {'ρ run':>5} {'α prof':>6} {'plain t/s':>9} {'spec t/s':>8} "
        f"{'measured':>8} {'predicted':>9} {'error':>7} {'pred(α prof)':>12}  same",
    ]
    for p in report.points:
        lines.append(
            f"  {p.category:14} {p.batch:>3} {p.k:>2} {p.alpha:6.2f} {p.proposal_rate:5.2f} {p.alpha_profile:6.2f} "
            f"{p.plain_tokens_per_s:9.1f} {p.spec_tokens_per_s:8.1f} {p.measured:7.2f}× {p.predicted:8.2f}× "
            f"{p.error:+7.1%} {p.predicted_profile:11.2f}×  {'yes' if p.identical else 'NO'}"
        )
    lines += [
        "",
        f"mean absolute percentage error: {report.mape:.1f}% (prediction from the run's α), "
        f"{report.mape_profile_alpha:.1f}% (from the profile's α per category)",
        "",
        "break-even concurrency (smallest batch where no k beats plain decoding):",
        f"  {'category':14} {'measured':>9} {'predicted':>9} {'profile scan':>12}",
    ]
    top = max(c.batches)
    for be in report.break_even:
        lines.append(
            f"  {be.category:14} {_batch(be.measured, top):>9} {_batch(be.predicted, top):>9} "
            f"{_batch(be.predicted_scan, top * 4):>12}"
        )
    return "\n".join(lines)


def _batch(value: int | None, top: int) -> str:
    return f"> {top}" if value is None else str(value)
