"""`specroute bench spec`: speculative decoding against plain decoding, per prompt category, at
batch 1, in one run — every drafter at each fixed k and at auto k — plus transformers' own assisted
generation (prompt lookup, and the draft model as `assistant_model`) on the same prompts as the
outside reference. With `--engine llamacpp` the loops run on llama.cpp, and the outside reference
is llama.cpp's own generation of the same GGUF file (`profiler.peers`), beside the float32 torch
loop. Each prompt runs every configuration back to back (rotating which goes
first), so machine noise hits all of them alike; greedy decoding, so every configuration must
produce the very same tokens, which the report checks.

It benches the held-out prompt set by default, and tunes on the project's own: before the timed
runs each drafter's acceptance map is fitted on the project set (a fixed-k run, as the profiler
does), and auto k starts from it on prompts it never saw; the report scores the map's
predictions on both sets (Brier, reliability)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, Field, field_validator
from tqdm import tqdm
from transformers import GenerationConfig

from backends.engines import gguf_file
from backends.engines.llamacpp import gguf_weight_types
from backends.generation import GenerationRequest, GenerationResult
from backends.models import LoadedModel, load_model
from backends.plain import PlainEngine
from backends.scheduler import DEFAULT_TILE_WIDTH, K_LIMIT, LoopSettings, Scheduler
from backends.speculative.control import StepCosts
from backends.speculative.drafters import Drafter, ModelDrafter
from backends.speculative.engine import SpeculativeEngine, step_costs
from backends.speculative.factory import build_drafter
from backends.speculative.stats import SpeculationStats
from policies.cost_model import run_speedup
from policies.drafters import BENCHED_KINDS, DrafterConfig, DrafterKind, spec
from policies.profile import AcceptanceMap, ReliabilityBin

from .hardware import MachineInfo, machine_info
from .peers import LlamaCppPeer
from .settings import LoopBenchTarget, load_target
from .workloads import PromptSetName, load_prompt_set

PLAIN = "plain"
NATURAL_WIDTHS = "plain, natural widths"
FLOAT32 = "plain, float32"  # the float32 plain backend: what a reduced-precision target must beat
PREDICTION_TOLERANCE = 0.15  # the lookahead issue's target: measured within 15% of a predicted win


class BenchSpecConfig(LoopBenchTarget):
    max_tokens: int = Field(96, ge=2, le=2048, description="upper bound per request; EOS ends a request earlier")
    categories: list[str] | None = Field(None, description="default: every category of the prompt set")
    prompts_per_category: int = Field(3, ge=1)
    prompt_set: PromptSetName = Field(
        "heldout", description="the prompts timed: 'heldout' (never tuned on) or 'project'"
    )
    drafters: list[DrafterKind] = Field(default_factory=lambda: list(BENCHED_KINDS), min_length=1)
    fixed_k: list[int] = Field(
        default_factory=lambda: [4], min_length=1, description="each fixed k every drafter runs at"
    )
    k_max: int = Field(8, ge=1, le=32)
    calibrate: bool = Field(True, description="fit each drafter's acceptance map on the project set first")
    calibration_prompts: int = Field(4, ge=1, le=50, description="project prompts per category the maps are fitted on")
    calibration_tokens: int = Field(64, ge=2, le=2048)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="drafter options (kind is ignored)")
    transformers: bool = Field(True, description="also time transformers' assisted generation")
    hf_prompt_lookup_tokens: int = Field(10, ge=1, description="transformers' prompt_lookup_num_tokens")
    tile_width: int = Field(
        DEFAULT_TILE_WIDTH,
        ge=2,
        le=K_LIMIT + 1,
        description="reduced precision: width of every loop's width-invariant passes (a lookahead block must fit)",
    )

    @property
    def loop(self) -> LoopSettings:
        # Rounds repeat the prompts: each must prefill in full, as the peer's and the first round's do.
        return LoopSettings(
            tile_width=self.tile_width, engine=self.engine, gguf_weights=self.gguf_weights, prefix_caching=False
        )

    @field_validator("fixed_k", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, int) else value  # reports written before fixed k became a list

    @field_validator("fixed_k")
    @classmethod
    def _ks(cls, value: list[int]) -> list[int]:
        if any(not 1 <= k <= 32 for k in value) or len(set(value)) != len(value):
            raise ValueError(f"fixed k values must be distinct integers from 1 to 32 (got {value})")
        return value


class CalibrationScore(BaseModel):
    """How well one drafter's acceptance predictions matched what was accepted, on one prompt set."""

    drafter: str
    prompt_set: str
    how: str = Field(
        description="'out of fold' (the map, prompts held out) or 'live' (the auto-k runs' own predictions)"
    )
    positions: int
    brier: float
    brier_constant: float = Field(description="a constant at the accepted share (out of fold: the folds' share)")
    reliability: list[ReliabilityBin]


class RunStats(BaseModel):
    """One configuration over one category's prompts."""

    name: str
    tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float = Field(description="tokens/s over plain tokens/s on the same prompts")
    decode_speedup: float | None = Field(
        None,
        description="decoding alone (after each request's first token: prefill is the same work for every "
        "configuration): plain's seconds per token over this run's",
    )
    predicted_speedup: float | None = Field(
        None,
        description="the cost model's decode speedup for this run: its steps as they ran (drafted tokens verified, "
        "pass width), each yielding E(α, k) at the run's α, over the probed pass costs at those widths plus the "
        "measured drafting time, in 1-token passes",
    )
    identical: bool = Field(description="greedy tokens equal plain decoding's, every prompt")
    diverged_prompts: int = Field(0, description="prompts whose greedy tokens differ from plain decoding's")
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    gamma: float | None = None
    mean_k: float | None = None


class CategoryResult(BaseModel):
    category: str
    prompts: int
    runs: list[RunStats]
    versus_transformers: dict[str, float] = Field(
        description="our tokens/s over the outside reference's (named pairs): transformers' own assisted "
        "generation on the torch engine, llama.cpp's own generation on the llamacpp engine"
    )


class BenchSpecReport(BaseModel):
    machine: MachineInfo
    model: dict[str, object]
    config: BenchSpecConfig
    step_costs_ms: dict[str, float] = Field(
        description="target forward pass at batch 1 by new tokens per pass: probed, then tracked over the run"
    )
    categories: list[CategoryResult]
    geomean_speedup: dict[str, float] = Field(description="per configuration, over categories")
    geomean_decode: dict[str, float] = Field(
        default_factory=dict, description="per configuration timed per token: decode speedup, over categories"
    )
    geomean_predicted: dict[str, float] = Field(
        default_factory=dict, description="per speculative configuration: the cost model's decode speedup"
    )
    geomean_versus_transformers: dict[str, float]
    calibration: list[CalibrationScore] = Field(default_factory=list)
    auto_versus_best_fixed: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="per drafter and category: auto k's tokens/s over the best fixed k's"
    )
    geomean_over_float32: dict[str, float] = Field(
        default_factory=dict,
        description="reduced precision: each configuration's speedup over the float32 plain loop (geometric mean)",
    )


@dataclass
class _Tally:
    tokens: int = 0
    seconds: float = 0.0
    diverged: int = 0
    decode_tokens: int = 0  # after each request's first
    decode_s: float = 0.0
    results: list[GenerationResult] = field(default_factory=list)


Runner = Callable[[GenerationRequest], GenerationResult | list[int]]


def run_bench_spec(config: BenchSpecConfig) -> BenchSpecReport:
    prompt_set = load_prompt_set(config.prompt_set)
    categories = config.categories or list(prompt_set.categories)
    unknown = sorted(set(categories) - set(prompt_set.categories))
    if unknown:  # before loading anything: the maps are fitted on these categories too
        raise ValueError(f"unknown categories {unknown}: choose from {sorted(prompt_set.categories)}")
    loaded = load_target(config)
    runners, pairs, costs, engines, maps = _runners(config, loaded)
    work = {c: prompt_set.categories[c].prompts[: config.prompts_per_category] for c in categories}
    total = len(runners) * (1 + sum(len(p) for p in work.values()))
    results = []
    with tqdm(total=total, desc="bench spec", unit="run", leave=False) as bar:
        _warm_up(runners, config, bar)
        for category, prompts in work.items():
            requests = [GenerationRequest(messages=p.messages, max_tokens=config.max_tokens) for p in prompts]
            results.append(_category(category, requests, runners, pairs, bar, _pass_cost(costs)))
    measured = {str(w): s * 1e3 for (b, w), s in sorted(costs.target_s.items()) if b == 1}
    scores = [*maps, *(_live_score(kind, engine, config.prompt_set) for kind, engine in engines.items())]
    return _report(config, loaded, results, measured, [s for s in scores if s is not None])


def _runners(
    config: BenchSpecConfig, loaded: LoadedModel
) -> tuple[dict[str, Runner], dict[str, str], StepCosts, dict[str, SpeculativeEngine], list[CalibrationScore]]:
    """name -> a function running one request; which of ours faces which transformers run; the
    step-cost table every speculative engine shares (probed once); each drafter's auto-k engine;
    and how its acceptance map, fitted on the project set, scored there."""
    plain = PlainEngine(loaded)
    drafters = {kind: build_drafter(config.drafter.of(kind), loaded) for kind in config.drafters}
    widest = max([max(config.k_max, *config.fixed_k) + 1, *(d.widest_block for d in drafters.values())])
    costs = step_costs(loaded, max_width=widest, settings=config.loop)
    runners: dict[str, Runner] = {PLAIN: lambda r: plain.generate([r])[0]}
    pairs: dict[str, str] = {}
    if config.engine == "llamacpp":
        runners, pairs = _llamacpp_runners(config, loaded)
    elif config.loop.tile(loaded.info.dtype) is not None:
        # Reduced precision: the exact reference is the plain step loop, width-invariant as the plain
        # backend serves it; plain decoding at natural widths runs beside it, for its speed and its drift.
        # And the float32 plain backend's loop, the exact reference a reduced precision competes with.
        loop = Scheduler(loaded, config.loop)
        reference = Scheduler(load_model(config.model, "float32", config.device, config.threads))
        runners = {
            PLAIN: lambda r: loop.generate([r])[0],
            NATURAL_WIDTHS: runners[PLAIN],
            FLOAT32: lambda r: reference.generate([r])[0],
        }
    autos: dict[str, SpeculativeEngine] = {}
    scores: list[CalibrationScore] = []
    for kind, drafter in drafters.items():
        # A structured drafter (lookahead) reports no per-position features: no map to fit.
        fitted = _calibrate(loaded, drafter, costs, config) if config.calibrate and not drafter.widest_block else None
        if fitted is not None and fitted.brier is not None:
            scores.append(_map_score(kind, fitted))
        for k in (*config.fixed_k, "auto"):  # a fresh drafter per engine, sharing any draft model
            engine = SpeculativeEngine(
                loaded, drafter.fresh(), k=k, k_max=config.k_max, costs=costs, settings=config.loop, acceptance=fitted
            )
            runners[speculative_run(kind, k)] = _engine_runner(engine)
        autos[kind] = engine
        if config.engine == "llamacpp":
            pairs[speculative_run(kind, "auto")] = LlamaCppPeer.name
            continue
        if not config.transformers:
            continue
        baseline = spec(kind).baseline
        if baseline == "prompt_lookup":
            runners["transformers prompt lookup"] = _hf_runner(
                plain, loaded, prompt_lookup_num_tokens=config.hf_prompt_lookup_tokens
            )
            pairs[speculative_run(kind, "auto")] = "transformers prompt lookup"
        if baseline == "assistant":
            draft = engine.drafter
            assert isinstance(draft, ModelDrafter)
            runners["transformers assisted"] = _hf_runner(plain, loaded, assistant_model=draft.model)
            pairs[speculative_run(kind, "auto")] = "transformers assisted"
    return runners, pairs, costs, autos, scores


def speculative_run(kind: str, k: int | str) -> str:
    """A speculative configuration's run name; every other run is plain decoding or a reference."""
    return f"{kind} k={k}"


def is_speculative(name: str) -> bool:
    return re.fullmatch(r".+ k=(\d+|auto)", name) is not None


def _llamacpp_runners(config: BenchSpecConfig, loaded: LoadedModel) -> tuple[dict[str, Runner], dict[str, str]]:
    """On the llamacpp engine: its plain loop (the reference every configuration must equal),
    llama.cpp's own generation of the same file, and the float32 torch loop (the exact float model)."""
    loop = Scheduler(loaded, config.loop)
    peer = LlamaCppPeer(gguf_file(loaded), torch.get_num_threads())
    reference = Scheduler(load_model(config.model, "float32", config.device, config.threads))

    def theirs(request: GenerationRequest) -> list[int]:
        return peer.generate(loop.plain.encode(request), request.max_tokens, loop.plain.eos_ids)

    runners: dict[str, Runner] = {
        PLAIN: lambda r: loop.generate([r])[0],
        LlamaCppPeer.name: theirs,
        FLOAT32: lambda r: reference.generate([r])[0],
    }
    return runners, {PLAIN: LlamaCppPeer.name}


def _calibrate(loaded: LoadedModel, drafter: Drafter, costs: StepCosts, config: BenchSpecConfig) -> AcceptanceMap:
    """The drafter's acceptance map, fitted the way the profiler fits it: the project set's
    prompts, each category as one greedy batch at fixed k = k_max, every judged position."""
    engine = SpeculativeEngine(loaded, drafter.fresh(), k=config.k_max, costs=costs, settings=config.loop)
    prompt_set = load_prompt_set("project")
    categories = config.categories or list(prompt_set.categories)
    for category in tqdm(categories, desc=f"acceptance map {drafter.name}", unit="category", leave=False):
        prompts = prompt_set.categories[category].prompts[: config.calibration_prompts]
        engine.generate([GenerationRequest(messages=p.messages, max_tokens=config.calibration_tokens) for p in prompts])
    return engine.acceptance_map()


def _map_score(kind: str, fitted: AcceptanceMap) -> CalibrationScore:
    assert fitted.brier is not None and fitted.brier_constant is not None
    return CalibrationScore(
        drafter=kind,
        prompt_set="project",
        how="out of fold",
        positions=fitted.samples,
        brier=fitted.brier,
        brier_constant=fitted.brier_constant,
        reliability=fitted.reliability,
    )


def _live_score(kind: str, engine: SpeculativeEngine, prompt_set: str) -> CalibrationScore | None:
    """The auto-k engine's own predictions over the timed runs (warm-up included) against what was
    accepted: the map's calibration on the benched prompts."""
    score = engine.predictors[engine.drafter.name].live_score()
    if score is None:
        return None
    positions, brier, constant, bins = score
    return CalibrationScore(
        drafter=kind,
        prompt_set=prompt_set,
        how="live",
        positions=positions,
        brier=brier,
        brier_constant=constant,
        reliability=bins,
    )


def _engine_runner(engine: SpeculativeEngine) -> Runner:
    return lambda request: engine.generate([request])[0]


def _hf_runner(plain: PlainEngine, loaded: LoadedModel, **assist: object) -> Runner:
    """transformers' `generate` with its own assisted decoding, greedy, stopping at the same EOS ids."""
    generation_config = GenerationConfig(
        do_sample=False,
        eos_token_id=sorted(plain.eos_ids),
        pad_token_id=loaded.tokenizer.pad_token_id,
        **{k: v for k, v in assist.items() if k != "assistant_model"},
    )
    extra = {"assistant_model": assist["assistant_model"]} if "assistant_model" in assist else {}

    def run(request: GenerationRequest) -> list[int]:
        prompt = plain.encode(request)
        input_ids = torch.tensor([prompt], device=loaded.model.device)
        generation_config.max_new_tokens = request.max_tokens
        with torch.inference_mode():
            output = loaded.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=generation_config,
                **extra,
            )
        return output[0, len(prompt) :].tolist()

    return run


def _warm_up(runners: dict[str, Runner], config: BenchSpecConfig, bar: tqdm) -> None:
    """First calls pay for step-cost probes, allocator growth and kernel selection: not timed."""
    request = GenerationRequest(prompt="Warm-up: count from one to five.", max_tokens=min(8, config.max_tokens))
    for run in runners.values():
        run(request)
        bar.update()


def _pass_cost(costs: StepCosts) -> Callable[[int], float]:
    """A batch-1 pass of this width in 1-token passes, by the run's step-cost table (its shape is
    probed; its level, tracked over the run, cancels out)."""
    return lambda width: costs.seconds(1, width) / costs.seconds(1, 1)


def _category(
    category: str,
    requests: list[GenerationRequest],
    runners: dict[str, Runner],
    pairs: dict[str, str],
    bar: tqdm,
    pass_cost: Callable[[int], float],
) -> CategoryResult:
    tallies = {name: _Tally() for name in runners}
    names = list(runners)
    for index, request in enumerate(requests):
        order = names[index % len(names) :] + names[: index % len(names)]  # rotate who goes first
        outputs = {}
        for name in order:
            started = time.perf_counter()
            output = runners[name](request)
            elapsed = time.perf_counter() - started
            outputs[name] = output
            tally = tallies[name]
            tally.seconds += elapsed
            if isinstance(output, GenerationResult):
                tally.results.append(output)
                after_first = max(0, len(output.token_ids) - 1)
                tally.decode_tokens += after_first
                tally.decode_s += output.tpot_s * after_first
            bar.update()
        reference = _tokens(outputs[PLAIN])
        for name, output in outputs.items():
            tokens = _tokens(output)
            tallies[name].tokens += len(tokens)
            tallies[name].diverged += tokens != reference
    plain = tallies[PLAIN]
    runs = [_run_stats(name, tally, plain, pass_cost) for name, tally in tallies.items()]
    rates = {run.name: run.tokens_per_s for run in runs}
    versus = {f"{ours} / {theirs}": rates[ours] / rates[theirs] for ours, theirs in pairs.items()}
    return CategoryResult(category=category, prompts=len(requests), runs=runs, versus_transformers=versus)


def _tokens(output: GenerationResult | list[int]) -> list[int]:
    return output.token_ids if isinstance(output, GenerationResult) else output


def _run_stats(name: str, tally: _Tally, plain: _Tally, pass_cost: Callable[[int], float]) -> RunStats:
    rate = tally.tokens / tally.seconds
    stats = [r.speculation for r in tally.results if r.speculation is not None]
    spec: dict[str, float] = {}
    if tally.decode_tokens and tally.decode_s > 0 and plain.decode_s > 0:
        spec["decode_speedup"] = (plain.decode_s / plain.decode_tokens) / (tally.decode_s / tally.decode_tokens)
    if stats:
        total = SpeculationStats.combined(stats)
        spec |= {
            "acceptance_rate": total.acceptance_rate,
            "mean_accepted_length": total.mean_accepted_length,
            "gamma": total.gamma,
            "mean_k": sum(total.k_history) / len(total.k_history) if total.k_history else 0.0,
        }
        if total.k_history and total.target_step_s > 0:
            spec["predicted_speedup"] = run_speedup(
                total.alpha,
                total.k_history,
                [pass_cost(w) for w in total.width_history],
                total.draft_time_s / total.target_step_s,
            )
    return RunStats(
        name=name,
        tokens=tally.tokens,
        seconds=tally.seconds,
        tokens_per_s=rate,
        speedup=rate / (plain.tokens / plain.seconds),
        identical=tally.diverged == 0,
        diverged_prompts=tally.diverged,
        **spec,
    )


def _report(
    config: BenchSpecConfig,
    loaded: LoadedModel,
    results: list[CategoryResult],
    step_costs_ms: dict[str, float],
    calibration: list[CalibrationScore],
) -> BenchSpecReport:
    geomean = _geomeans(results, "speedup")
    predicted, decode = _geomeans(results, "predicted_speedup"), _geomeans(results, "decode_speedup")
    versus_names = list(results[0].versus_transformers)
    versus = {name: _geomean([c.versus_transformers[name] for c in results]) for name in versus_names}
    return BenchSpecReport(
        machine=machine_info(),
        model=_model_description(config, loaded),
        config=config,
        step_costs_ms=step_costs_ms,
        categories=results,
        geomean_speedup=geomean,
        geomean_decode=decode,
        geomean_predicted=predicted,
        geomean_versus_transformers=versus,
        calibration=calibration,
        auto_versus_best_fixed={kind: _auto_over_fixed(kind, config, results) for kind in config.drafters},
        geomean_over_float32={n: g / geomean[FLOAT32] for n, g in geomean.items() if n != FLOAT32}
        if FLOAT32 in geomean
        else {},
    )


def _model_description(config: BenchSpecConfig, loaded: LoadedModel) -> dict[str, object]:
    """The target as loaded, and on the llamacpp engine what llama.cpp says of the file it ran."""
    described = loaded.info.as_dict()
    if config.engine == "llamacpp":
        described["gguf_types"] = gguf_weight_types(gguf_file(loaded, config.gguf_weights))
        described["gguf_weights"] = config.gguf_weights
        described["peer_gguf_types"] = gguf_weight_types(gguf_file(loaded))  # llama.cpp's own runs the file as shipped
    return described


def _auto_over_fixed(kind: str, config: BenchSpecConfig, results: list[CategoryResult]) -> dict[str, float]:
    out = {}
    for category in results:
        rates = {run.name: run.tokens_per_s for run in category.runs}
        auto, fixed = speculative_run(kind, "auto"), [speculative_run(kind, k) for k in config.fixed_k]
        out[category.category] = rates[auto] / max(rates[name] for name in fixed)
    return out


def _geomeans(results: list[CategoryResult], figure: str) -> dict[str, float]:
    """Per configuration that has this figure in every category, its geometric mean over them."""
    values: dict[str, list[float]] = {}
    for category in results:
        for run in category.runs:
            values.setdefault(run.name, []).append(getattr(run, figure) or 0.0)
    return {name: _geomean(v) for name, v in values.items() if all(v)}


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


def render_report(report: BenchSpecReport) -> str:
    m, c = report.model, report.config
    lines = [
        f"specroute bench spec — {m['name']} ({_engine_label(c, m)}, {m['device']}) on {report.machine.cpu}, "
        f"{report.machine.torch_threads} torch threads; batch 1, greedy, ≤{c.max_tokens} tokens, "
        f"{c.prompts_per_category} prompts per category of the {c.prompt_set} set, fixed k = "
        f"{', '.join(map(str, c.fixed_k))}, auto k ≤ {c.k_max}"
        + (
            f"; acceptance maps fitted on the project set ({c.calibration_prompts} prompts per category)"
            if c.calibrate
            else ""
        ),
    ]
    if report.step_costs_ms:
        costs = "  ".join(f"{w}:{ms:.0f}" for w, ms in report.step_costs_ms.items())
        lines.append(f"target pass (ms) by new tokens per pass, probed then tracked over the run: {costs}")
        lines.append(f"  v(1, k), a pass verifying k drafts in 1-token passes: {_verify_costs(report.step_costs_ms)}")
    header = f"  {'configuration':28} {'tok/s':>7} {'speedup':>8} {'decode':>7} {'model':>6} {'α':>5} {'acc.len':>7}"
    header += f" {'γ':>6} {'k̄':>5}  same"
    for category in report.categories:
        lines += ["", f"{category.category} ({category.prompts} prompts)", header]
        lines += [_run_line(run) for run in category.runs]
        lines += [
            f"  ours over {_reference(name)}: {name} = {ratio:.2f}×"
            for name, ratio in category.versus_transformers.items()
        ]
    lines += ["", "geometric mean over categories — speedup over plain; decoding alone; the cost model's:"]
    lines += [
        f"  {name:28} {value:6.2f}×"
        + (f" {report.geomean_decode[name]:6.2f}×" if name in report.geomean_decode else "")
        + (f" {report.geomean_predicted[name]:6.2f}×" if name in report.geomean_predicted else "")
        for name, value in report.geomean_speedup.items()
    ]
    lines += _prediction_lines(report)
    lines += [f"  {name}: {value:.2f}×" for name, value in report.geomean_versus_transformers.items()]
    if report.geomean_over_float32:
        exact = {r.name for c in report.categories for r in c.runs}
        exact -= {r.name for c in report.categories for r in c.runs if not r.identical}
        lines += [
            "",
            "geometric mean over categories — speedup over the float32 plain loop (exact: same tokens as plain):",
        ]
        lines += [
            f"  {name:28} {value:6.2f}×{'  exact' if name in exact else ''}"
            for name, value in report.geomean_over_float32.items()
        ]
    if report.auto_versus_best_fixed:
        lines += ["", "auto k over the best fixed k, per category (tokens/s):"]
        for kind, ratios in report.auto_versus_best_fixed.items():
            worst = min(ratios, key=ratios.get)
            parts = "  ".join(f"{c} {r:.2f}" for c, r in ratios.items())
            lines.append(f"  {kind:20} {parts}  (lowest: {worst} {ratios[worst]:.2f})")
    if report.calibration:
        lines += ["", "acceptance predictions (Brier score; lower is better, a constant in brackets):"]
        lines += [
            f"  {s.drafter:20} {s.prompt_set:8} {s.how:12} {s.positions:6} positions  "
            f"{s.brier:.3f} ({s.brier_constant:.3f})  reliability: "
            + " ".join(f"{b.mean_predicted:.2f}→{b.accepted_share:.2f}" for b in s.reliability)
            for s in report.calibration
        ]
    return "\n".join(lines)


def _engine_label(config: BenchSpecConfig, model: dict[str, object]) -> str:
    """What the loops computed in: the torch target's dtype, or llama.cpp and the file's weight types."""
    if config.engine == "llamacpp":
        label = f"llama.cpp engine, {model.get('gguf_types') or 'GGUF'}"
        if model.get("gguf_weights", "file") != "file":
            label += (
                f" requantized from the file; llama.cpp's own generation runs it as shipped, {model['peer_gguf_types']}"
            )
        return label
    return str(model["dtype"])


def _verify_costs(step_costs_ms: dict[str, float]) -> str:
    one = step_costs_ms.get("1")
    if not one:
        return "—"
    return "  ".join(f"k={int(w) - 1}: {ms / one:.2f}" for w, ms in step_costs_ms.items() if int(w) > 1)


def _reference(name: str) -> str:
    return "llama.cpp" if LlamaCppPeer.name in name else "transformers"


def _prediction_lines(report: BenchSpecReport) -> list[str]:
    """Where the cost model predicted a win, how far the measured speedup fell from it."""
    wins = [(c.category, r) for c in report.categories for r in c.runs if (r.predicted_speedup or 0.0) > 1.0]
    if not wins:
        return ["", "the cost model predicted a win for no configuration in any category"]
    ratios = [(c, r, (r.decode_speedup or 0.0) / (r.predicted_speedup or 1.0)) for c, r in wins]
    within = sum(abs(ratio - 1.0) <= PREDICTION_TOLERANCE for _, _, ratio in ratios)
    lines = [
        "",
        f"where the cost model predicted a win: {within} of {len(wins)} category runs' decode speedup within "
        f"{PREDICTION_TOLERANCE:.0%} of it (measured / predicted):",
    ]
    lines += [f"  {category:16} {r.name:28} {ratio:5.2f}" for category, r, ratio in ratios]
    return lines


def _run_line(run: RunStats) -> str:
    def number(value: float | None, digits: int = 2) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    def times(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f}×"

    return (
        f"  {run.name:28} {run.tokens_per_s:7.1f} {run.speedup:7.2f}× {times(run.decode_speedup):>7} "
        f"{times(run.predicted_speedup):>6} "
        f"{number(run.acceptance_rate):>5} "
        f"{number(run.mean_accepted_length):>7} {number(run.gamma, 3):>6} {number(run.mean_k, 1):>5}  "
        f"{'yes' if run.identical else f'NO ({run.diverged_prompts} differ)'}"
    )
