"""`specroute profile`: measure, on this machine, everything the policy decides with — the target's
pass time t(b, n) by batch and new tokens per sequence, prefill time by prompt length, each
drafter's step cost, acceptance per prompt category and drafter — fit the α predictor from the
per-prompt acceptance, cross-validate it, and write the versioned profile (JSON)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator
from tqdm import tqdm

from backends.embedded import specroute_home
from backends.generation import GenerationRequest, GenerationResult
from backends.kv import PagedCache
from backends.models import LoadedModel, load_model
from backends.plain import PlainEngine
from backends.quantized import QuantMethod, measure_quality, quantize
from backends.speculative.control import StepCosts
from backends.speculative.drafters import Drafter, ModelDrafter
from backends.speculative.engine import K_LIMIT, SpeculativeEngine, measure_step_times, step_costs
from backends.speculative.factory import DrafterConfig, DrafterKind, build_drafter
from backends.speculative.stats import SpeculationStats
from policies.profile import (
    AcceptanceProfile,
    AcceptanceSample,
    CostCurve,
    DrafterProfile,
    ModelSummary,
    Profile,
    QuantizedProfile,
)

from .hardware import machine_info
from .predictor import cross_validate
from .settings import ModelSettings
from .workloads import WorkloadPrompt, check_categories, load_prompt_set, quantization_split

PREFILL_REPEATS = 3


class ProfileConfig(ModelSettings):
    batches: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64], min_length=2)
    max_width: int = Field(9, ge=2, le=K_LIMIT + 1, description="widest pass measured: k up to max_width - 1")
    context_tokens: int = Field(
        192, ge=1, le=4096, description="tokens already in every sequence's cache while passes are timed"
    )
    repeats: int = Field(5, ge=1, le=50, description="timed tries per pass (the fastest counts)")
    prefill_lengths: list[int] = Field(default_factory=lambda: [16, 64, 256, 1024], min_length=1)
    drafters: list[DrafterKind] = Field(default_factory=lambda: ["ngram", "model"])
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="drafter options (kind is ignored)")
    acceptance_k: int = Field(8, ge=1, description="k every drafter runs at while its acceptance is measured")
    max_tokens: int = Field(64, ge=2, le=2048)
    categories: list[str] | None = None
    prompts_per_category: int | None = Field(None, ge=1, description="default: every prompt of the set")
    folds: int = Field(5, ge=2)
    quantization: QuantMethod | None = Field("smoothquant", description="int8 method to measure; null: none")
    quality_tokens: int = Field(32, ge=1, le=512, description="greedy tokens per prompt the int8 agreement reads")

    _known_categories = field_validator("categories")(check_categories)

    @model_validator(mode="after")
    def _consistent(self) -> ProfileConfig:
        for name in ("batches", "prefill_lengths"):
            values = getattr(self, name)
            if values != sorted(set(values)) or values[0] < 1:
                raise ValueError(f"{name} must be positive and strictly increasing (got {values})")
        if self.acceptance_k > self.max_width - 1:
            raise ValueError(f"acceptance_k ({self.acceptance_k}) needs max_width ≥ {self.acceptance_k + 1}")
        return self


def default_profile_path(model: str = "embedded", dtype: str = "float32", device: str = "cpu") -> Path:
    """One profile per model, dtype and device under SPECROUTE_HOME (default ~/.cache/specroute)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model.strip("/")).strip("_") or "model"
    return specroute_home() / "profiles" / f"{slug}-{dtype}-{device}.json"


def run_profile(config: ProfileConfig, progress: bool = True) -> Profile:
    loaded = load_model(config.model, dtype=config.dtype, device=config.device, threads=config.threads)
    widths = list(range(1, config.max_width + 1))
    target = measure_curve(loaded, config, widths, "target t(b, n)", progress)
    prefill = measure_prefill(loaded, config.prefill_lengths, progress)
    costs = seeded_step_costs(loaded, target)
    drafters, acceptance, samples = [], [], []
    for kind in config.drafters:
        drafter = build_drafter(config.drafter.model_copy(update={"kind": kind}), loaded)
        measured, prompt_samples, in_run = measure_acceptance(loaded, drafter, costs, config, progress)
        acceptance += measured
        samples += prompt_samples
        drafters.append(drafter_profile(loaded, drafter, kind, config, in_run, progress))
    quantized = measure_quantized(loaded, config, config.quantization, progress) if config.quantization else None
    return Profile(
        created=datetime.now(UTC),
        machine=machine_info().model_dump(),
        model=_model_summary(loaded),
        libraries={name: version(name) for name in ("torch", "transformers", "scikit-learn", "numpy")},
        settings=config.model_dump(mode="json"),
        target=target,
        prefill=prefill,
        drafters=drafters,
        acceptance=acceptance,
        samples=samples,
        predictor=[s for t in ("alpha", "proposal_rate") for s in cross_validate(samples, config.folds, target=t)],
        quantized=quantized,
    )


def measure_quantized(
    loaded: LoadedModel, config: ProfileConfig, method: QuantMethod, progress: bool
) -> QuantizedProfile:
    """The int8 backend as it will be served: smoothed on one half of the prompt set, its 1-token
    pass timed like the target's, its quality measured on the other half."""
    calibration, evaluation = quantization_split()
    engine = PlainEngine(loaded)
    int8 = quantize(loaded, [engine.encode(_request(p, 1)) for p in calibration], method)
    curve = measure_curve(int8, config, [1], f"int8 {method} t(b, 1)", progress)
    requests = [_request(p, config.quality_tokens) for p in evaluation]
    answers = engine.generate(requests)
    sequences = [engine.encode(r) + a.token_ids for r, a in zip(requests, answers, strict=True)]
    texts = [m.content for p in evaluation for m in p.messages]
    quality = measure_quality(loaded, int8, sequences, texts)
    return QuantizedProfile(
        method=method, curve=curve, agreement=quality.agreement, perplexity_delta=quality.perplexity_delta
    )


def _request(prompt: WorkloadPrompt, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(messages=prompt.messages, max_tokens=max_tokens)


def measure_curve(
    loaded: LoadedModel, config: ProfileConfig, widths: Sequence[int], label: str, progress: bool
) -> CostCurve:
    """Fastest of `repeats` pass times for every batch × width, `context_tokens` cached per sequence."""
    context, repeats = config.context_tokens, config.repeats
    rows = [
        list(measure_step_times(loaded.model, b, widths, context, repeats).values())
        for b in tqdm(config.batches, desc=label, unit="batch", disable=not progress)
    ]
    return CostCurve(batches=list(config.batches), widths=list(widths), seconds=rows)


@torch.inference_mode()
def measure_prefill(loaded: LoadedModel, lengths: Sequence[int], progress: bool) -> CostCurve:
    """Best-of-3 prefill seconds of one prompt of each length: the time to first token."""
    model = loaded.model
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for length in tqdm(lengths, desc="prefill", unit="length", disable=not progress):
        best = float("inf")
        for _ in range(PREFILL_REPEATS):
            prompt = torch.randint(0, vocab, (1, length), generator=generator).tolist()
            started = time.perf_counter()
            cache = PagedCache(model, length)
            float(cache.last_logits([cache.add()], prompt)[0, 0])  # reading a value waits for the device
            best = min(best, time.perf_counter() - started)
        seconds.append(best)
    return CostCurve(batches=[1], widths=list(lengths), seconds=[seconds])


def seeded_step_costs(loaded: LoadedModel, curve: CostCurve) -> StepCosts:
    """The engine's step-cost table started from a measured curve, so runs need no probing of their own."""
    costs = step_costs(loaded, max_width=curve.max_width)
    for b, row in zip(curve.batches, curve.seconds, strict=True):
        if b & (b - 1) == 0:  # the engine keys its table by power-of-two buckets
            costs.target_s.update({(b, w): s for w, s in zip(curve.widths, row, strict=True)})
    return costs


def measure_acceptance(
    loaded: LoadedModel, drafter: Drafter, costs: StepCosts, config: ProfileConfig, progress: bool
) -> tuple[list[AcceptanceProfile], list[AcceptanceSample], dict[int, float]]:
    """Each category's prompts as one greedy batch at the fixed k (greedy tokens do not depend on the
    batch); per category and per prompt acceptance, and what one draft step (a token for every row)
    cost in those runs by batch bucket, in steady state (the engine leaves out the drafter's
    start-up and catch-up after plain steps)."""
    engine = SpeculativeEngine(loaded, drafter, k=config.acceptance_k, costs=costs)
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
    in_run = dict(sorted(engine.draft_costs.step_s.items()))
    if not in_run:  # runs too short to draft twice in a row: every draft call, start-up included
        totals = engine.totals
        in_run = {1: totals.draft_time_s / max(1, sum(k for k in totals.k_history if k > 0))}
    return measured, samples, in_run


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
    prompt_id: str, category: str, drafter: str, request: GenerationRequest, result: GenerationResult
) -> AcceptanceSample:
    stats = result.speculation
    assert stats is not None  # the speculative engine always attaches its statistics
    text, turns = request.text_and_turns()
    return AcceptanceSample(
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
    if not isinstance(drafter, ModelDrafter):
        return DrafterProfile(name=drafter.name, kind=kind, batches=list(in_run), step_seconds=list(in_run.values()))
    probed = [
        measure_step_times(drafter.model, b, [1], config.context_tokens, config.repeats)[1]
        for b in tqdm(config.batches, desc=f"draft step {drafter.name}", unit="batch", disable=not progress)
    ]
    probe = DrafterProfile(name=drafter.name, kind=kind, batches=list(config.batches), step_seconds=probed)
    calibration = float(np.median([s / probe.step_at(b) for b, s in in_run.items()]))
    return probe.model_copy(
        update={"step_seconds": [s * calibration for s in probed], "probed_seconds": probed, "calibration": calibration}
    )


def _model_summary(loaded: LoadedModel) -> ModelSummary:
    info = loaded.info
    return ModelSummary(
        name=info.name,
        dtype=info.dtype,
        device=info.device,
        parameters=info.parameters,
        weight_bytes=info.weight_bytes,
        threads=torch.get_num_threads(),
    )
