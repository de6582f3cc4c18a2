"""`specroute profile`: measure, on this machine, everything the policy decides with — the target's
pass time t(b, n) by batch and new tokens per sequence, prefill time by prompt length, each
drafter's step cost, acceptance per prompt category and drafter — fit the α predictor from the
per-prompt acceptance, cross-validate it, and write the versioned profile (JSON).

Acceptance and the int8 model's agreement belong to the model and drafter, not to the machine.
For the embedded default they ship with specroute (`profiler/defaults/`, written by
`specroute profile --ship-acceptance`): a profile then measures only the machine's costs, which
takes minutes rather than a quarter of an hour. Any other model, dtype or acceptance setting is
measured in full."""

from __future__ import annotations

import functools
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator
from tqdm import tqdm

from backends.embedded import EMBEDDED_NAME, specroute_home
from backends.engines import gguf_file
from backends.engines.llamacpp import kv_bytes_per_token as llamacpp_kv_bytes
from backends.engines.llamacpp import measure_llamacpp_curve, measure_llamacpp_prefill, score_sequence
from backends.generation import GenerationRequest, GenerationResult
from backends.kv import PagedCache, kv_bytes_per_token, kv_values_per_token
from backends.models import LoadedModel, load_model
from backends.plain import PlainEngine
from backends.quantized import (
    Quality,
    Reference,
    calibration_cache,
    compare_quality,
    drafting_settings,
    max_weight_error,
    measure_quality,
    needs_calibration,
    quantize,
    reference_side,
    resolve_method,
)
from backends.scheduler import LoopSettings, Scheduler, seeded_step_costs
from backends.speculative.drafters import Drafter, ModelDrafter
from backends.speculative.engine import K_LIMIT, SpeculativeEngine, measure_step_times
from backends.speculative.factory import build_drafter
from backends.speculative.stats import SpeculationStats
from backends.training.prompts import TrainingPrompt, training_prompts
from policies.drafters import SERVED_KINDS, DrafterConfig, DrafterKind, spec
from policies.engines import (
    DEFAULT_QUANTIZED_WEIGHTS,
    ENGINES,
    GGUF_METHOD_PREFIX,
    EngineName,
    GgufWeights,
    check_quantized_drafters,
    gguf_method,
    quantized_drafters,
    with_engine_drafters,
)
from policies.profile import (
    AcceptanceProfile,
    AcceptanceSample,
    AcceptanceSeed,
    ContextCurve,
    CostCurve,
    DrafterName,
    DrafterProfile,
    ModelSummary,
    Profile,
    ProfileError,
    QuantizedProfile,
    SampleSet,
    ShippedQuality,
)
from policies.quantization import QuantChoice, speculation_refusal

from .hardware import machine_info
from .predictor import cross_validate
from .settings import ModelSettings
from .workloads import WorkloadPrompt, check_categories, load_prompt_set, quantization_split

PREFILL_REPEATS = 3
PREFILL_ENOUGH_S = 3.0
SEEDS_DIR = Path(__file__).parent / "defaults"
# What the shipped acceptance must have been measured with to stand in for a measurement now.
SEED_SETTINGS = ("acceptance_k", "max_tokens", "categories", "prompts_per_category")
QUALITY_SETTINGS = ("quality_tokens", "quality_prompts")  # what shipped quality must have been measured with
SEED_DTYPES = ("float32", "bfloat16")  # the dtypes the service serves the embedded default in
TIMING_PROMPTS = 2  # per category, in the short run that times each drafter when acceptance ships
TIMING_TOKENS = 24
TRAINING_DRAW_SEED = 0  # which training-set prompts the profile measures
# The quick probe (`quick_config`), sized to answer within ~90 s of `specroute serve` on 2 cores.
PROBE_REPEATS = 1
PROBE_PREFILL = [64]
PROBE_PROMPTS = 2  # per category, where a probe must measure acceptance (nothing ships for the model)
PROBE_QUALITY_PROMPTS = 1  # per category: a llama.cpp probe's quality against the float target (the full run: all)


class ProfileConfig(ModelSettings):
    batches: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64], min_length=2)
    max_width: int = Field(9, ge=2, le=K_LIMIT + 1, description="widest pass measured: k up to max_width - 1")
    context_tokens: int = Field(
        192, ge=1, le=4096, description="tokens already in every sequence's cache while passes are timed"
    )
    contexts: list[int] = Field(
        default_factory=lambda: [64, 512, 1024, 2048],
        min_length=1,
        description="cached-context lengths the context curve times passes at (context_tokens is added); empty-ish "
        "grids are cut by context_budget_s and context_max_tokens",
    )
    context_budget_s: float = Field(
        150.0, ge=0, description="seconds the context curve may take (0: not measured); cells past it are left out"
    )
    context_max_tokens: int = Field(
        32768, ge=1, description="the context curve skips batch × context above this many cached tokens"
    )
    repeats: int = Field(5, ge=1, le=50, description="timed tries per pass (the fastest counts)")
    curve_sweeps: int = Field(
        2, ge=1, le=8, description="times the target curve's batch grid is swept (up, down, …), sharing the repeats"
    )
    enough_s: float = Field(
        3.0, ge=0, description="a batch's tries stop after two once they took this long (big passes vary little)"
    )
    prefill_lengths: list[int] = Field(default_factory=lambda: [16, 64, 256, 1024], min_length=1)
    drafters: list[DrafterKind] = Field(default_factory=lambda: list(SERVED_KINDS))
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="drafter options (kind is ignored)")
    acceptance_k: int = Field(8, ge=1, description="k every drafter runs at while its acceptance is measured")
    training_prompts: int = Field(
        100,
        ge=0,
        description="prompts per category of the larger training set (backends.training) whose acceptance is also "
        "measured, as more examples for the α/ρ predictor only (0: none); shipped with the acceptance",
    )
    max_tokens: int = Field(64, ge=2, le=2048)
    categories: list[str] | None = None
    prompts_per_category: int | None = Field(None, ge=1, description="default: every prompt of the set")
    folds: int = Field(5, ge=2)
    quantization: list[QuantChoice] = Field(
        default_factory=lambda: ["auto"],
        description="quantization methods to measure, the served one first ('auto': the weight-only method the "
        "weights fit); empty: none",
    )
    engine: EngineName = Field("torch", description=f"what runs the target's passes ({', '.join(ENGINES)})")
    gguf_weights: GgufWeights = Field(
        "file", description="engine llamacpp: the weights the plain and speculative backends serve"
    )
    gguf_quantized: list[GgufWeights] = Field(
        default_factory=lambda: [DEFAULT_QUANTIZED_WEIGHTS],
        description="engine llamacpp: the weight types measured for the quantized backend, the served one first "
        "(`quantization` names torch's methods); empty: none",
    )
    quantized_drafters: list[DrafterKind] | None = Field(
        None,
        description="the drafters the quantized backend speculates with: its passes are timed at every width and "
        "their acceptance measured on its own tokens (null: the engine's default, as the service's)",
    )
    quality_tokens: int = Field(32, ge=1, le=512, description="greedy tokens per prompt the quantized quality reads")
    quality_prompts: int | None = Field(
        None, ge=1, description="prompts per category of the held-out half the quantized quality reads (default: all)"
    )
    acceptance: Literal["auto", "measure", "shipped"] = Field(
        "auto",
        description="auto: use the acceptance shipped for this model when it fits these settings, else measure; "
        "measure: always measure; shipped: refuse unless the shipped acceptance fits",
    )
    probe: bool = Field(
        False,
        description="a quick probe (`quick_config`): the profile is marked provisional, the predictor is not "
        "cross-validated and shipped acceptance is not timed in a run; acceptance that has to be measured is "
        "measured on PROBE_PROMPTS prompts a category",
    )

    _known_categories = field_validator("categories")(check_categories)

    @model_validator(mode="after")
    def _consistent(self) -> ProfileConfig:
        for name in ("batches", "prefill_lengths"):
            values = getattr(self, name)
            if values != sorted(set(values)) or values[0] < 1:
                raise ValueError(f"{name} must be positive and strictly increasing (got {values})")
        if self.acceptance_k > self.max_width - 1:
            raise ValueError(f"acceptance_k ({self.acceptance_k}) needs max_width ≥ {self.acceptance_k + 1}")
        self.loop()  # the engine and weights go together (LoopSettings says how)
        check_quantized_drafters(self.quantized_drafters, self.drafters)
        return self

    @property
    def stacked(self) -> list[DrafterKind]:
        """The quantized backend's drafters (the engine's default unless named), among those profiled."""
        return [k for k in quantized_drafters(self.engine, self.quantized_drafters) if k in self.drafters]

    def loop(self) -> LoopSettings:
        """The step loop the profiled backends run: the engine and the weights it serves."""
        # The profile measures uncached costs (prompts repeat across its runs): no prefix cache.
        return LoopSettings(engine=self.engine, gguf_weights=self.gguf_weights, prefix_caching=False)

    _engine_drafters = model_validator(mode="before")(with_engine_drafters)


def quick_config(config: ProfileConfig) -> ProfileConfig:
    """The probe `specroute serve` measures before its first answer where no profile exists: every
    pass of the full run's batches and widths timed PROBE_REPEATS times in one sweep (the batch
    buckets the speculative backend would otherwise probe at its start), no context curve, one
    prefill length, a draft model's bare pass at each batch, and neither drafters' timed runs (where
    acceptance ships) nor the quantized backend, which the policy does not route to until the full
    profile measures it. The acceptance settings stay the full run's, so the shipped acceptance
    fits as it would there."""
    return ProfileConfig.model_validate(
        {
            **config.model_dump(),
            "probe": True,
            "repeats": PROBE_REPEATS,
            "curve_sweeps": 1,
            "context_budget_s": 0.0,
            "prefill_lengths": PROBE_PREFILL,
            "quantization": [],
            "gguf_quantized": [],
            "quality_prompts": PROBE_QUALITY_PROMPTS,
        }
    )


def batches_up_to(largest: int) -> list[int]:
    """Powers of two from 1 up to the first that reaches `largest` (two at least)."""
    batches = [1, 2]
    while batches[-1] < largest:
        batches.append(batches[-1] * 2)
    return batches


def default_profile_path(
    model: str = "embedded", dtype: str = "float32", device: str = "cpu", loop: LoopSettings | None = None
) -> Path:
    """One profile per model, dtype (on llama.cpp: the weights served) and device under
    SPECROUTE_HOME (default ~/.cache/specroute)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model.strip("/")).strip("_") or "model"
    if loop is not None and loop.engine == "llamacpp":
        dtype = gguf_method(loop.gguf_weights)
    return specroute_home() / "profiles" / f"{slug}-{dtype}-{device}.json"


def run_profile(
    config: ProfileConfig,
    progress: bool = True,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.perf_counter,
) -> Profile:
    """`clock`: what the context curve's time budget is read on (a profiler that is paused while a
    service answers requests passes one that stands still while it is paused)."""
    loaded = load_model(config.model, dtype=config.dtype, device=config.device, threads=config.threads)
    loop = config.loop()
    seed = usable_seed(loaded, config, log)
    if seed is None and config.probe:
        config = _probe_acceptance(config, log)
    built = {kind: build_drafter(config.drafter.of(kind), loaded) for kind in config.drafters}
    # A structured drafter's pass (lookahead's block) may be wider than any k asks for: measure it too.
    widths = list(range(1, max([config.max_width, *(d.widest_block for d in built.values())]) + 1))
    target = measure_curve(loaded, config, widths, "target t(b, n)", progress)
    # The context curve times torch's paged attention; on llama.cpp passes read as flat in context.
    timed_context = config.context_budget_s and loop.engine == "torch"
    context = measure_context(loaded, config, widths, progress, clock) if timed_context else None
    prefill = measure_prefill(loaded, config, progress)
    costs = seeded_step_costs(loaded, target, loop, context=context)
    drafters, acceptance, samples, shipped, maps = [], [], [], [], []
    for kind, drafter in built.items():
        engine = SpeculativeEngine(loaded, drafter, k=config.acceptance_k, costs=costs, settings=loop)
        from_seed = seed if seed is not None and seed_fits(seed, config, kind, drafter.name) else None
        # A probe leaves the timed run to the full profile: a draft model's run is its slowest part.
        ran = from_seed is None or not config.probe
        if from_seed is None:
            measured, prompt_samples, in_run = measure_acceptance(engine, config, progress)
        else:
            runs = timed_seed if ran else untimed_seed
            measured, prompt_samples, in_run = runs(engine, config, from_seed, progress)
            shipped.append(drafter.name)
        acceptance += measured
        samples += prompt_samples + training_samples(engine, config, from_seed, progress)
        if ran:  # the judged positions of those runs (fixed k: every position up to the first rejection)
            maps.append(engine.acceptance_map())
        drafters.append(drafter_profile(loaded, drafter, kind, config, in_run, progress))
    # read once for every method
    reference = functools.cache(lambda: quality_reference(loaded, config.quality_prompts, config.quality_tokens))
    if loop.engine == "llamacpp":
        # A probe takes the weights' shipped quality (the slowest part of its run); the full profile measures it.
        shipped_served = _shipped_quality(seed, config, gguf_method(loop.gguf_weights)) if config.probe else None
        qualities: list[ShippedQuality | None] = [shipped_served]
        served = shipped_served or served_quality(loaded, loop, reference)
        quantized = [measure_gguf_quantized(loaded, config, w, progress, reference) for w in config.gguf_quantized]
    else:
        served = None  # the float target is the reference
        methods = list(dict.fromkeys(resolve_method(loaded, choice) for choice in config.quantization))
        qualities = [_shipped_quality(seed, config, method) for method in methods]
        quantized = [
            measure_quantized(loaded, config, method, progress, quality, reference)
            for method, quality in zip(methods, qualities, strict=True)
        ]
    return Profile(
        created=datetime.now(UTC),
        machine=machine_info().model_dump(),
        model=_model_summary(loaded, loop, served),
        libraries={name: version(name) for name in ("torch", "transformers", "scikit-learn", "numpy")},
        settings=config.model_dump(mode="json"),
        target=target,
        context=context,
        prefill=prefill,
        drafters=drafters,
        acceptance=acceptance,
        samples=samples,
        # Scores for the report only (the router refits the predictor from the samples): not worth a probe's time.
        predictor=[]
        if config.probe
        else [s for t in ("alpha", "proposal_rate") for s in cross_validate(samples, config.folds, target=t)],
        acceptance_maps=maps,
        quantized=quantized[0] if quantized else None,
        quantized_others=quantized[1:],
        acceptance_source=_source(seed, shipped, [q.method for q in qualities if q is not None], loop.engine),
        provisional=config.probe,
    )


def _probe_acceptance(config: ProfileConfig, log: Callable[[str], None]) -> ProfileConfig:
    """A probe without shipped acceptance measures it on a few prompts a category, none of the
    training set: rough α and ρ per category until the full run measures them."""
    log(f"the probe measures acceptance on {PROBE_PROMPTS} prompts a category (the full profile on all of them)")
    return config.model_copy(update={"prompts_per_category": PROBE_PROMPTS, "training_prompts": 0})


def _shipped_quality(seed: AcceptanceSeed | None, config: ProfileConfig, method: str) -> ShippedQuality | None:
    """The seed's quality of `method`, if it was measured as this profile would measure it: as many
    greedy tokens a prompt, on at least as many prompts (a probe reads fewer than the full run)."""
    if seed is None or seed.settings.get("quality_tokens") != config.quality_tokens:
        return None
    shipped, asked = seed.settings.get("quality_prompts"), config.quality_prompts
    if shipped is not None and (asked is None or not isinstance(shipped, int) or shipped < asked):
        return None
    return seed.quality_of(method)


def _source(seed: AcceptanceSeed | None, shipped: list[str], quality: list[str], engine: str = "torch") -> str:
    if seed is None or not (shipped or quality):
        return "measured"
    parts = ([f"acceptance of {', '.join(shipped)}"] if shipped else []) + (
        [f"{', '.join(quality)} quality"] if quality else []
    )
    where = seed.machine.get("cpu") or "another machine"
    source = f"shipped with specroute: {' and '.join(parts)}, measured {seed.created:%Y-%m-%d} on {where}"
    if engine != "torch":
        source += f" on the {seed.dtype} torch target, standing in for {engine}'s own until the full profile"
    return source


@contextmanager
def all_cores() -> Iterator[None]:
    """Every core for untimed work; the threads the timings are measured with come back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, os.cpu_count() or 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def seed_path(model_name: str, folder: Path | None = None, dtype: str = "float32") -> Path:
    """Where the acceptance shipped for a model in a dtype lives (in the package unless `folder`
    says otherwise)."""
    suffix = "" if dtype == "float32" else f".{dtype}"
    return (folder or SEEDS_DIR) / f"{model_name.lower()}{suffix}.json"


def usable_seed(loaded: LoadedModel, config: ProfileConfig, log: Callable[[str], None]) -> AcceptanceSeed | None:
    """The shipped acceptance for this model if it may stand in for measuring (see `_seed_problem`);
    None means measure. `acceptance: shipped` turns a misfit into an error."""
    if config.acceptance == "measure":
        return None
    if config.engine != "torch":  # the seed holds the float target's tokens; this engine's are its own
        if config.acceptance == "shipped":
            raise ProfileError(f"acceptance ships for the torch engine's float target, not for {config.engine}")
        if not config.probe:
            log(f"measuring acceptance on {config.engine}: its weights are a numerical model of their own")
            return None
        # A probe starts from the float target's (its tokens agree with these weights' ~97 % of the time
        # here); the full profile measures this engine's own. `_source` says which the profile holds.
        log(f"the probe starts from the float target's shipped acceptance; the full profile measures {config.engine}'s")
    path = seed_path(loaded.info.name, dtype=loaded.info.dtype)
    seed = AcceptanceSeed.load(path) if path.is_file() else None
    problem = _seed_problem(seed, loaded, config)
    if problem is None:
        log(f"acceptance ships for {loaded.info.name}: measuring only this machine's costs ({path})")
        return seed
    if config.acceptance == "shipped":
        raise ProfileError(f"cannot use shipped acceptance: {problem} (profile with --acceptance measure)")
    log(f"measuring acceptance too: {problem}")
    return None


def _seed_problem(seed: AcceptanceSeed | None, loaded: LoadedModel, config: ProfileConfig) -> str | None:
    if seed is None:
        return f"none ships for {loaded.info.name}"
    if loaded.info.dtype != seed.dtype:
        return f"it was measured in {seed.dtype}, the target runs in {loaded.info.dtype}"
    if seed.fingerprint != loaded.fingerprint:
        return f"it was measured on another {seed.model} (the weights' fingerprint differs)"
    asked = config.model_dump(mode="json")
    differ = [name for name in SEED_SETTINGS if seed.settings.get(name) != asked[name]]
    if differ:
        return f"it was measured with other {', '.join(differ)}"
    return None


def seed_fits(seed: AcceptanceSeed, config: ProfileConfig, kind: str, name: str) -> bool:
    """The seed holds this drafter, built with the same options."""
    shipped = seed.settings.get("drafter")
    if not isinstance(shipped, dict):
        return False
    try:
        shipped_config = DrafterConfig.model_validate({**shipped, "kind": kind})
    except ValueError:  # options of an older specroute
        return False
    # Compared as the seed's target ran them: a draft dtype of auto is what it resolved to there.
    ran, asked = (_options(c.of(kind), seed.dtype) for c in (shipped_config, config.drafter))
    return ran == asked and any(d.name == name for d in seed.drafters)


def _options(config: DrafterConfig, target_dtype: str) -> dict[str, object]:
    options = {o: getattr(config, o) for o in spec(config.kind).options}
    if "draft_dtype" in options:
        options["draft_dtype"] = config.draft_dtype_under(target_dtype)
    return options


def timed_seed(
    engine: SpeculativeEngine, config: ProfileConfig, seed: AcceptanceSeed, progress: bool
) -> tuple[list[AcceptanceProfile], list[AcceptanceSample], dict[int, float]]:
    """The shipped acceptance of the engine's drafter, with what drafting costs on this machine
    measured in a short run (a few prompts per category, one batch) at the profile's fixed k: its
    in-run step cost by batch bucket and γ, which replaces the shipped runs' γ (that one was timed
    elsewhere)."""
    drafter = engine.drafter
    prompt_set = load_prompt_set()
    prompts = [
        p
        for c in config.categories or list(prompt_set.categories)
        for p in prompt_set.categories[c].prompts[:TIMING_PROMPTS]
    ]
    requests = [GenerationRequest(messages=p.messages, max_tokens=TIMING_TOKENS) for p in prompts]
    with tqdm(total=1, desc=f"draft timing {drafter.name}", unit="run", disable=not progress) as bar:
        results = engine.generate(requests)
        bar.update()
    stats = SpeculationStats.combined([r.speculation for r in results if r.speculation is not None])
    measured = [a.model_copy(update={"gamma": stats.gamma}) for a in seed.acceptance if a.drafter == drafter.name]
    samples = [s for s in seed.samples if s.drafter == drafter.name and s.prompt_set == "project"]
    return measured, samples, _in_run_costs(engine)


def untimed_seed(
    engine: SpeculativeEngine, config: ProfileConfig, seed: AcceptanceSeed, progress: bool
) -> tuple[list[AcceptanceProfile], list[AcceptanceSample], dict[int, float]]:
    """The shipped acceptance of the engine's drafter as it ships (γ as timed where it was
    measured), with no run: no in-run draft costs."""
    name = engine.drafter.name
    samples = [s for s in seed.samples if s.drafter == name and s.prompt_set == "project"]
    return [a for a in seed.acceptance if a.drafter == name], samples, {}


def training_samples(
    engine: SpeculativeEngine, config: ProfileConfig, seed: AcceptanceSeed | None, progress: bool
) -> list[AcceptanceSample]:
    """Per-prompt acceptance of the engine's drafter on `training_prompts` prompts per category of
    the training set, which only the predictor reads (the profiled set's ~10 prompts a category
    are too few to learn prompt-level α from): the seed's when it holds this drafter's, measured
    with the same count, else measured now, each category as one greedy batch at the profile's k."""
    if not config.training_prompts:
        return []
    if seed is not None and seed.settings.get("training_prompts") == config.training_prompts:
        shipped = [s for s in seed.samples if s.drafter == engine.drafter.name and s.prompt_set == "training"]
        if shipped:
            return shipped
    samples = []
    label = f"training-set acceptance {engine.drafter.name}"
    for category, prompts in tqdm(training_set(config).items(), desc=label, unit="category", disable=not progress):
        requests = [GenerationRequest(messages=p.messages(), max_tokens=config.max_tokens) for p in prompts]
        results = engine.generate(requests)
        samples += [
            _sample(p.id, category, engine.drafter.name, q, r, prompt_set="training")
            for p, q, r in zip(prompts, requests, results, strict=True)
        ]
    return samples


def training_set(config: ProfileConfig) -> dict[str, list[TrainingPrompt]]:
    """`training_prompts` prompts of each training-set category the profile covers, a fixed random
    draw (so every topic and phrasing can appear, and a seed's samples stay comparable)."""
    prompts = training_prompts()
    random.Random(TRAINING_DRAW_SEED).shuffle(prompts)
    wanted = set(config.categories or load_prompt_set().categories)
    by_category: dict[str, list[TrainingPrompt]] = {}
    for prompt in prompts:
        if prompt.category in wanted and len(by_category.setdefault(prompt.category, [])) < config.training_prompts:
            by_category[prompt.category].append(prompt)
    return by_category


def write_seed(profile: Profile, path: Path | None = None) -> Path:
    """The machine-independent half of a fully measured profile of the embedded default (float32
    or bfloat16), as the acceptance that ships with specroute for that dtype; of a llama.cpp
    profile, its weights' measured quality, added to the float32 seed (`ship_llamacpp_quality`)."""
    model = profile.model
    if model.engine == "llamacpp":
        return ship_llamacpp_quality(profile, path)
    if model.name != EMBEDDED_NAME or model.dtype not in SEED_DTYPES or model.fingerprint is None:
        raise ProfileError(
            f"acceptance ships only for the embedded default in {' or '.join(SEED_DTYPES)} (this is {model.name} "
            f"in {model.dtype}): any other model is profiled in full on its machine"
        )
    if profile.acceptance_source != "measured":
        raise ProfileError("--ship-acceptance needs acceptance measured in this run: add --acceptance measure")
    seed = AcceptanceSeed(
        created=profile.created,
        model=model.name,
        dtype=model.dtype,
        fingerprint=model.fingerprint,
        machine=profile.machine,
        libraries=profile.libraries,
        settings={k: profile.settings[k] for k in (*SEED_SETTINGS, "drafter", *QUALITY_SETTINGS, "training_prompts")},
        drafters=[DrafterName(name=d.name, kind=d.kind) for d in profile.drafters],
        acceptance=list(profile.acceptance),
        samples=list(profile.samples),
        quality=shipped_quality(profile) + _llamacpp_qualities(path or seed_path(model.name, dtype=model.dtype)),
    )
    target = path or seed_path(model.name, dtype=model.dtype)
    seed.save(target)
    return target


def _llamacpp_qualities(path: Path) -> list[ShippedQuality]:
    """The llama.cpp weights' qualities the seed at `path` ships (kept when torch's are re-shipped)."""
    old = AcceptanceSeed.load(path) if path.is_file() else None
    return [q for q in old.quality if q.method.startswith(GGUF_METHOD_PREFIX)] if old else []


def ship_llamacpp_quality(profile: Profile, path: Path | None = None) -> Path:
    """A llama.cpp profile's weights' quality against the float target (the served weights' and each
    quantized type's), written into the embedded default's float32 seed, so that a first start on
    llama.cpp takes it instead of measuring it before its first answer (its full profile measures
    it on the machine). Refused unless measured as a probe would read it (QUALITY_SETTINGS)."""
    model = profile.model
    target = path or seed_path(model.name, dtype="float32")
    if model.name != EMBEDDED_NAME or model.quality is None or not target.is_file():
        raise ProfileError("llama.cpp quality ships for the embedded default, beside its float32 seed")
    seed = AcceptanceSeed.load(target)
    differ = [n for n in QUALITY_SETTINGS if profile.settings.get(n) != seed.settings.get(n)]
    if differ:
        raise ProfileError(f"the seed's quality was measured with other {', '.join(differ)}: profile with the seed's")
    where = f"{profile.machine.get('cpu') or 'another machine'}, {profile.created:%Y-%m-%d}"
    fresh = [q.model_copy(update={"measured_on": where}) for q in [model.quality, *shipped_quality(profile)]]
    kept = [q for q in seed.quality if q.method not in {f.method for f in fresh}]
    seed.model_copy(update={"quality": kept + fresh}).save(target)
    return target


def shipped_quality(profile: Profile) -> list[ShippedQuality]:
    """The machine-independent half of every quantized method the profile measured."""
    measured = [q for q in [profile.quantized, *profile.quantized_others] if q is not None]
    return [
        ShippedQuality(
            method=q.method, agreement=q.agreement, perplexity_delta=q.perplexity_delta, greedy_match=q.greedy_match
        )
        for q in measured
    ]


def measure_quantized(
    loaded: LoadedModel,
    config: ProfileConfig,
    method: str,
    progress: bool,
    shipped: ShippedQuality | None,
    reference: Callable[[], Reference],
) -> QuantizedProfile:
    """The quantized backend as it will be served: (smoothed on one half of the prompt set, for
    the W8A8 methods,) its 1-token pass timed like the target's, its quality measured on the other
    half (or shipped); `reference`: the float target's side of that measurement (shared between methods)."""
    calibration, _ = quantization_split(config.quality_prompts)
    engine = PlainEngine(loaded)
    calibration_ids = [engine.encode(_request(p, 1)) for p in calibration] if needs_calibration(method) else []
    with all_cores():  # an untimed pass over every calibration token: no reason to leave a core idle
        quantized = quantize(loaded, calibration_ids, method, calibration_cache())  # type: ignore[arg-type]
    kinds = config.stacked if speculation_refusal(method) is None else []
    loop = drafting_settings(config.loop(), bool(kinds))  # timed as it will run
    widths = list(range(1, config.max_width + 1)) if kinds else [1]
    measured = {
        "method": method,
        "curve": measure_curve(quantized, config, widths, f"{method} t(b, n)", progress, loop=loop),
        "weight_bytes": quantized.info.weight_bytes,
        "max_weight_error": max_weight_error(quantized.model),
        "acceptance": quantized_acceptance(quantized, config, kinds, loop, progress),
        "tile_width": loop.tile(quantized.info.dtype),
    }
    if shipped is not None:
        return QuantizedProfile(
            **measured,
            agreement=shipped.agreement,
            perplexity_delta=shipped.perplexity_delta,
            greedy_match=shipped.greedy_match,
        )
    with all_cores():  # untimed, and the slowest part of a first start without shipped quality
        quality = measure_quality(reference(), quantized)
    return QuantizedProfile(
        **measured,
        agreement=quality.agreement,
        perplexity_delta=quality.perplexity_delta,
        greedy_match=quality.greedy_match,
    )


def quality_reference(loaded: LoadedModel, prompts: int | None, tokens: int) -> Reference:
    """The float target's answers (`tokens` each), teacher-forced argmax and perplexity on the
    held-out half of the quality prompts (`prompts` per category; None: all)."""
    _, evaluation = quantization_split(prompts)
    requests = [_request(p, tokens) for p in evaluation]
    with all_cores():
        return reference_side(loaded, requests, [m.content for p in evaluation for m in p.messages])


def measure_gguf_quality(ref: Reference, loaded: LoadedModel, weights: GgufWeights) -> Quality:
    """The llama.cpp engine serving `weights` against the float target's `ref`: its step loop's
    greedy answers, and its teacher-forced logits and perplexity (llama.cpp passes of its own)."""
    path = gguf_file(loaded, weights)
    loop = Scheduler(loaded, LoopSettings(engine="llamacpp", gguf_weights=weights, max_batch=4, prefix_caching=False))
    try:
        answers = [r.token_ids for r in loop.generate(list(ref.requests))]
    finally:
        loop.close()
    return compare_quality(ref, answers, lambda ids: score_sequence(path, ids, torch.get_num_threads()))


def measure_gguf_quantized(
    loaded: LoadedModel,
    config: ProfileConfig,
    weights: GgufWeights,
    progress: bool,
    reference: Callable[[], Reference],
) -> QuantizedProfile:
    """The llama.cpp engine's quantized backend: the file requantized to `weights`, its 1-token pass
    timed like the target's, its quality against the float target measured as the served
    weights' is (`measure_gguf_quality`)."""
    kinds, loop = config.stacked, LoopSettings(engine="llamacpp", gguf_weights=weights, prefix_caching=False)
    widths = list(range(1, config.max_width + 1)) if kinds else [1]
    curve = measure_curve(loaded, config, widths, f"{weights} t(b, n)", progress, weights)
    with all_cores():
        quality = measure_gguf_quality(reference(), loaded, weights)
    return QuantizedProfile(
        method=gguf_method(weights),
        curve=curve,
        acceptance=quantized_acceptance(loaded, config, kinds, loop, progress),
        weight_bytes=gguf_file(loaded, weights).stat().st_size,
        agreement=quality.agreement,
        perplexity_delta=quality.perplexity_delta,
        greedy_match=quality.greedy_match,
    )


def quantized_acceptance(
    target: LoadedModel, config: ProfileConfig, kinds: Sequence[DrafterKind], loop: LoopSettings, progress: bool
) -> list[AcceptanceProfile]:
    """Acceptance of each drafter on the quantized model's own tokens (`loop`: its passes as served),
    per category as the target's is measured: a different numerical model proposes and accepts
    differently, so its α is measured, not taken from the target's."""
    measured: list[AcceptanceProfile] = []
    for kind in kinds:
        engine = SpeculativeEngine(
            target, build_drafter(config.drafter.of(kind), target), config.acceptance_k, settings=loop
        )
        try:
            measured += measure_acceptance(engine, config, progress)[0]
        finally:
            engine.close()
    return measured


def _request(prompt: WorkloadPrompt, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(messages=prompt.messages, max_tokens=max_tokens)


def measure_curve(
    loaded: LoadedModel,
    config: ProfileConfig,
    widths: Sequence[int],
    label: str,
    progress: bool,
    weights: GgufWeights | None = None,
    loop: LoopSettings | None = None,
) -> CostCurve:
    """Fastest pass time for every batch × width, `context_tokens` cached per sequence, through
    passes shaped as the step loop runs them in this dtype (width-invariant in reduced precision at
    the batches the loop tiles: there every width up to the tile costs one tile-wide pass). The
    batch grid is swept `curve_sweeps` times, up then down, the `repeats` tries shared out among
    the sweeps: on a shared machine a slow spell of a few seconds can outlast every try of one
    batch in a row (seen: a row 30% slow), but it rarely covers the same batch minutes apart. On
    the llama.cpp engine: its passes over the weights served (`weights`, default the config's).
    `loop`: the step loop's settings the passes are shaped by (default the config's)."""
    context, loop, dtype = config.context_tokens, loop or config.loop(), loaded.info.dtype
    tile = loop.tile(dtype)
    if tile is not None and max(widths) > tile:
        raise ProfileError(
            f"{dtype} passes are width-invariant, {tile} positions wide: profile with max_width ≤ {tile}"
        )
    repeats = -(-config.repeats // config.curve_sweeps)
    best = {b: dict.fromkeys(widths, float("inf")) for b in config.batches}
    order = [b for sweep in range(config.curve_sweeps) for b in config.batches[:: -1 if sweep % 2 else 1]]
    if config.engine == "llamacpp":  # each sweep in one llama.cpp context, its rows filled once
        gguf, threads = gguf_file(loaded, weights or config.gguf_weights), torch.get_num_threads()
        sweeps = [order[i : i + len(config.batches)] for i in range(0, len(order), len(config.batches))]
        for sweep in tqdm(sweeps, desc=label, unit="sweep", disable=not progress):
            for b, times in measure_llamacpp_curve(gguf, sweep, widths, threads, context, repeats).items():
                best[b] = {w: min(best[b][w], times[w]) for w in widths}
    else:
        for b in tqdm(order, desc=label, unit="batch", disable=not progress):
            times = measure_step_times(
                loaded.model, b, widths, context, repeats, config.enough_s, tile, loop.tile_max_rows
            )
            best[b] = {w: min(best[b][w], times[w]) for w in widths}
    rows = [list(best[b].values()) for b in config.batches]
    return CostCurve(batches=list(config.batches), widths=list(widths), seconds=rows)


def measure_context(
    loaded: LoadedModel,
    config: ProfileConfig,
    widths: Sequence[int],
    progress: bool,
    clock: Callable[[], float] = time.perf_counter,
) -> ContextCurve | None:
    """Pass times over several cached-context lengths: batches from the smallest, contexts from
    the shortest, at the narrowest, a middle and the widest pass, until `context_budget_s` is spent
    on `clock` (cells left are None) or a batch × context exceeds `context_max_tokens`. None when
    fewer than two contexts of any batch fit."""
    contexts = sorted({*config.contexts, config.context_tokens})
    picked = sorted({widths[0], widths[len(widths) // 2], widths[-1]})
    loop, dtype = LoopSettings(prefix_caching=False), loaded.info.dtype
    tile = loop.tile(dtype)
    started, grid = clock(), []
    bar = tqdm(
        total=len(config.batches) * len(contexts), desc="target t(b, w, context)", unit="cell", disable=not progress
    )
    for b in config.batches:
        row: list[list[float | None]] = []
        for n in contexts:
            bar.update()
            if b * n > config.context_max_tokens or clock() - started > config.context_budget_s:
                row.append([None] * len(picked))
                continue
            times = measure_step_times(
                loaded.model, b, picked, n, config.repeats, config.enough_s, tile, loop.tile_max_rows
            )
            row.append([times[w] for w in picked])
        grid.append(row)
    bar.close()
    try:
        return ContextCurve(
            reference=config.context_tokens,
            batches=list(config.batches),
            contexts=contexts,
            widths=picked,
            seconds=grid,
        )
    except ValueError:  # no batch got two contexts within the budget
        return None


def measure_prefill(loaded: LoadedModel, config: ProfileConfig, progress: bool) -> CostCurve:
    """Best-of-3 prefill seconds of one prompt of each of the config's lengths (best of 2 for long
    ones): the time to first token, on the engine the config names."""
    lengths = config.prefill_lengths
    if config.engine == "llamacpp":
        path = gguf_file(loaded, config.gguf_weights)
        bar = tqdm(lengths, desc="prefill", unit="length", disable=not progress)
        seconds = [measure_llamacpp_prefill(path, n, torch.get_num_threads(), PREFILL_REPEATS) for n in bar]
        return CostCurve(batches=[1], widths=list(lengths), seconds=[seconds])
    return measure_torch_prefill(loaded, lengths, progress)


@torch.inference_mode()
def measure_torch_prefill(loaded: LoadedModel, lengths: Sequence[int], progress: bool) -> CostCurve:
    """Prefill on the torch engine (see `measure_prefill`)."""
    model = loaded.model
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for length in tqdm(lengths, desc="prefill", unit="length", disable=not progress):
        best, spent = float("inf"), 0.0
        for attempt in range(PREFILL_REPEATS):
            if attempt >= 2 and spent > PREFILL_ENOUGH_S:
                break  # a long prompt's prefill varies little: the best of two will do
            prompt = torch.randint(0, vocab, (1, length), generator=generator).tolist()
            started = time.perf_counter()
            cache = PagedCache(model, length)
            float(cache.last_logits([cache.add()], prompt)[0, 0])  # reading a value waits for the device
            best = min(best, time.perf_counter() - started)
            spent += time.perf_counter() - started
        seconds.append(best)
    return CostCurve(batches=[1], widths=list(lengths), seconds=[seconds])


def measure_acceptance(
    engine: SpeculativeEngine, config: ProfileConfig, progress: bool
) -> tuple[list[AcceptanceProfile], list[AcceptanceSample], dict[int, float]]:
    """Each category's prompts as one greedy batch at the engine's fixed k (greedy tokens do not
    depend on the batch); per category and per prompt acceptance, and what one draft step (a token
    for every row) cost in those runs by batch bucket, in steady state (the engine leaves out the
    drafter's start-up and catch-up after plain steps)."""
    drafter = engine.drafter
    prompt_set = load_prompt_set()
    categories = config.categories or list(prompt_set.categories)
    measured, samples = [], []
    for category in tqdm(categories, desc=f"acceptance {drafter.name}", unit="category", disable=not progress):
        prompts = prompt_set.categories[category].prompts[: config.prompts_per_category]
        requests = [GenerationRequest(messages=p.messages, max_tokens=config.max_tokens) for p in prompts]
        results = engine.generate(requests)
        stats = [r.speculation for r in results if r.speculation is not None]
        measured.append(
            acceptance_profile(category, config.acceptance_k, len(prompts), SpeculationStats.combined(stats))
        )
        samples += [
            _sample(p.id, category, drafter.name, q, r) for p, q, r in zip(prompts, requests, results, strict=True)
        ]
    return measured, samples, _in_run_costs(engine)


def _in_run_costs(engine: SpeculativeEngine) -> dict[int, float]:
    """Seconds per draft step by batch bucket in the engine's runs, in steady state."""
    in_run = dict(sorted(engine.draft_costs.step_s.items()))
    if not in_run:  # runs too short to draft twice in a row: every draft call, start-up included
        totals = engine.totals
        in_run = {1: totals.draft_time_s / max(1, sum(k for k in totals.k_history if k > 0))}
    return in_run


def acceptance_profile(category: str, k: int, prompts: int, stats: SpeculationStats) -> AcceptanceProfile:
    steps = stats.requested_steps
    return AcceptanceProfile(
        category=category,
        drafter=stats.drafter,
        k=k,
        prompts=prompts,
        steps=steps,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        judged_tokens=stats.judged_tokens,
        alpha=stats.alpha,
        acceptance_rate=stats.acceptance_rate,
        proposal_rate=stats.proposal_rate,
        drafts=stats.drafts,
        accepted_per_position=[n / steps for n in stats.accepted_per_position] if steps else [],
        mean_accepted_length=stats.mean_accepted_length,
        tokens_per_step=stats.tokens_per_step,
        gamma=stats.gamma,
    )


def _sample(
    prompt_id: str,
    category: str,
    drafter: str,
    request: GenerationRequest,
    result: GenerationResult,
    prompt_set: SampleSet = "project",
) -> AcceptanceSample:
    stats = result.speculation
    assert stats is not None  # the speculative engine always attaches its statistics
    text, turns = request.text_and_turns()
    return AcceptanceSample(
        prompt_set=prompt_set,
        prompt_id=prompt_id,
        category=category,
        drafter=drafter,
        text=text,
        turns=turns,
        prompt_tokens=result.prompt_tokens,
        judged_tokens=stats.judged_tokens,
        accepted_tokens=stats.accepted_tokens,
        alpha=stats.alpha,
        requested_steps=stats.requested_steps,
        drafts=stats.drafts,
        proposal_rate=stats.proposal_rate,
    )


def drafter_profile(
    loaded: LoadedModel,
    drafter: Drafter,
    kind: DrafterKind,
    config: ProfileConfig,
    in_run: dict[int, float],
    progress: bool,
) -> DrafterProfile:
    """A model drafter's step is one forward pass of its model: probed at every batch like the
    target, then scaled by how much more drafting really cost in the acceptance runs at the batch
    buckets they went through (the median ratio: catch-up passes, sampling and bookkeeping the
    probe does not see). Prompt lookup runs no model: its in-run cost per bucket is kept as is."""
    extra = added_weight_bytes(drafter, loaded.model)
    if not isinstance(drafter, ModelDrafter):
        block = {"block_width": drafter.widest_block, "block_draft": drafter.max_draft} if drafter.widest_block else {}
        return DrafterProfile(
            name=drafter.name,
            kind=kind,
            batches=list(in_run) or [1],
            step_seconds=list(in_run.values()) or [0.0],  # a drafter that never drafted spent nothing drafting
            weight_bytes=extra,
            **block,
        )
    probed = [
        measure_step_times(drafter.model, b, [1], config.context_tokens, config.repeats, config.enough_s)[1]
        for b in tqdm(config.batches, desc=f"draft step {drafter.name}", unit="batch", disable=not progress)
    ]
    probe = DrafterProfile(
        name=drafter.name, kind=kind, batches=list(config.batches), step_seconds=probed, weight_bytes=extra
    )
    # No run (a probe's shipped acceptance): the bare pass stands for the step until the full run calibrates it.
    calibration = float(np.median([s / probe.step_at(b) for b, s in in_run.items()])) if in_run else 1.0
    return probe.model_copy(
        update={"step_seconds": [s * calibration for s in probed], "probed_seconds": probed, "calibration": calibration}
    )


def added_weight_bytes(drafter: Drafter, target: torch.nn.Module) -> int:
    """Bytes of the tensors a drafter's own modules hold that the target does not already hold
    (early exit and trained heads share the target's layers and embeddings; a draft model does not)."""
    shared = {t.data_ptr() for t in (*target.parameters(), *target.buffers())}
    seen: set[int] = set()
    total = 0
    for module in (m for m in vars(drafter).values() if isinstance(m, torch.nn.Module)):
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.data_ptr() not in shared and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
    return total


def served_quality(loaded: LoadedModel, loop: LoopSettings, reference: Callable[[], Reference]) -> Quality | None:
    """On llama.cpp: its served weights' quality against the float target (`reference`), which the
    policy's floor admits or refuses; None on torch (the float target is the reference)."""
    if loop.engine != "llamacpp":
        return None
    with all_cores():
        return measure_gguf_quality(reference(), loaded, loop.gguf_weights)


def _model_summary(loaded: LoadedModel, loop: LoopSettings, quality: Quality | ShippedQuality | None) -> ModelSummary:
    """The target as profiled; on llama.cpp with its weights' `quality`, measured (or as shipped)."""
    info = loaded.info
    summary = ModelSummary(
        name=info.name,
        dtype=info.dtype,
        device=info.device,
        parameters=info.parameters,
        weight_bytes=info.weight_bytes,
        threads=torch.get_num_threads(),
        fingerprint=loaded.fingerprint,
        kv_bytes_per_token=kv_bytes_per_token(loaded.model),
        tile_width=loop.tile(info.dtype),
        tile_max_rows=loop.tile_max_rows,
        linear_kernels=info.linear_kernels,
    )
    if quality is None:
        return summary
    return summary.model_copy(
        update={
            "engine": loop.engine,
            "gguf_weights": loop.gguf_weights,
            "weight_bytes": gguf_file(loaded, loop.gguf_weights).stat().st_size,
            "kv_bytes_per_token": llamacpp_kv_bytes(kv_values_per_token(loaded.model)),
            "linear_kernels": None,
            "quality": quality
            if isinstance(quality, ShippedQuality)
            else ShippedQuality(
                method=gguf_method(loop.gguf_weights),
                agreement=quality.agreement,
                perplexity_delta=quality.perplexity_delta,
                greedy_match=quality.greedy_match,
            ),
        }
    )
