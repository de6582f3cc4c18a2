"""The three backends as Ray Serve deployments — thin shells: the step loop does the work.

Every replica runs one `Scheduler` (`backends.scheduler`) in a thread of its own
(`backends.serving`): requests join the running batch at the next step and leave it the moment
they finish, so load turns into batch size without anyone waiting for a batch to end.

- `SpeculativeBackend`: the loop with every configured drafter (prompt lookup, a draft model, …):
  rows draft with their own drafter and are verified together in one target pass per step, each
  step choosing how much drafting pays at the live batch.
- `PlainBackend`: the loop without drafting: large-batch decoding, where high concurrency goes.
- `QuantizedBackend`: the plain loop over the quantized target (`backends.quantized`).

Each exposes `generate(request, drafter, batching)` — an async stream of `StreamEvent`s. A request
the backend cannot serve (too long for the context, an unknown drafter) gets an event with `error`
(a 4xx), a full backend an event with `error` and `retry_after_s` (a 429). `batching="static"`
serves the request through the old engine queue (batches run to completion) on a loop of its own:
the baseline `specroute bench load --batching` measures against, never the serving path. Torch
threads are set per replica: Ray starts replicas with one, and several replicas on few cores must
not oversubscribe them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from ray import serve

from policies.drafters import SERVED_KINDS, DrafterConfig, DrafterKind
from policies.engines import (
    DEFAULT_QUANTIZED_WEIGHTS,
    ENGINE_CHOICES,
    QUANTIZED_DRAFTER_KINDS,
    EngineChoice,
    GgufWeights,
    check_quantized_drafters,
    gguf_method,
    quantized_drafters,
    with_engine_drafters,
)
from policies.profile import Profile
from policies.quantization import QuantChoice, speculation_refusal

from .embedded import ensure_model_here
from .errors import ModelLoadError, Overloaded, RequestError
from .generation import ChatMessage, GenerationRequest, GenerationResult, TokenListener
from .loop_metrics import LoopRecorder
from .models import LoadedModel, load_model
from .plain import PlainEngine
from .quantized import calibration_cache, drafting_settings, needs_calibration, quantize, resolve_method
from .scheduler import (
    PLAIN_ROW,
    LoopSettings,
    Scheduler,
    profile_acceptance_maps,
    seeded_draft_costs,
    seeded_step_costs,
    step_costs,
)
from .serving import ServingLoop
from .speculative.control import StepCosts
from .speculative.factory import build_drafter
from .streaming import EngineQueue, StreamEvent

BackendName = Literal["speculative", "plain", "quantized"]
BACKENDS: tuple[BackendName, ...] = ("speculative", "plain", "quantized")
Batching = Literal["continuous", "static"]
STUCK_S = 120.0  # a step takes well under a second here; two minutes without one is a hang


class BackendSettings(LoopSettings):
    """What every backend replica is built from (the `args` of the Serve application): the model,
    and how its step loop schedules."""

    model: str = Field("embedded", description="'embedded', a local directory, a .gguf file or a HF id")
    engine: EngineChoice = Field(  # type: ignore[assignment]  # a replica gets it decided, as the dtype
        "torch",
        description=f"what runs the target's passes ({', '.join(ENGINE_CHOICES)}); auto: the service picks the engine "
        "this machine's profiles predict faster whose weights meet the quality floor (policies.serving_dtype), "
        "before any replica starts",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="the target's dtype; auto: the service picks the exact dtype this machine's profiles say is "
        "faster (policies.serving_dtype) before any replica starts",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="where every replica runs its model")
    threads: int = Field(1, ge=1, le=256, description="torch threads per replica")
    batch_wait_ms: float = Field(20.0, ge=0, le=10_000, description="static baseline only: how long a batch waits")
    drafters: list[DrafterKind] = Field(
        default_factory=lambda: list(SERVED_KINDS),
        min_length=1,
        description="the drafters the speculative backend loads; the policy picks among them per request",
    )
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="drafter options (kind ignored)")
    k_max: int = Field(8, ge=1, le=32, description="most tokens a speculative step drafts")
    quantization: QuantChoice = Field(
        "auto",
        description="the quantized backend's method ('auto': int4-weight-only for weights on a group-32 4-bit "
        "grid, as GGUF Q4 checkpoints are, else int8-weight-only)",
    )
    quantized_weights: GgufWeights = Field(
        DEFAULT_QUANTIZED_WEIGHTS,
        description="engine llamacpp: the quantized backend's weights, the .gguf file requantized to this type "
        "(`quantization` names torch's methods)",
    )
    quantized_drafters: list[DrafterKind] | None = Field(
        None,
        description="the drafters the quantized backend speculates with, per step where it pays (quantization "
        f"stacked with speculation; {' or '.join(QUANTIZED_DRAFTER_KINDS)}, among `drafters`); null: the engine's "
        "default (llamacpp: ngram; torch: none, see policies.engines.default_quantized_drafters); []: plain only",
    )
    profile: str | None = Field(None, description="profile JSON: seeds the speculative engine's step costs")
    profile_data: dict[str, Any] | None = Field(
        None,
        description="the profile itself, which the app builder reads once and passes to every replica so "
        "that a replica on another node needs no copy of the file (set by the builder, not for config files)",
    )
    calibration: list[list[ChatMessage]] = Field(
        default_factory=list,
        description="quantized backend: the chat prompts its int8 smoothing calibrates on (the app builder "
        "passes the prompt set's calibration half, the one the profiler did not measure quality on)",
    )

    _engine_drafters = model_validator(mode="before")(with_engine_drafters)

    @model_validator(mode="after")
    def _quantized_drafters_served(self) -> BackendSettings:
        check_quantized_drafters(self.quantized_drafters, self.drafters)
        return self


class _Backend:
    """Shared shell: load, build the step loop, stream each request through it."""

    name: BackendName

    def __init__(self, settings: dict[str, Any]):
        self.settings = BackendSettings.model_validate(settings)
        s = self.settings
        if "auto" in (s.dtype, s.engine):  # resolved by the app builder (router.service.resolve_dtype)
            raise ModelLoadError("a backend replica needs its engine and dtype decided, not auto")
        ensure_model_here(s.model)
        self.loaded = load_model(s.model, dtype=s.dtype, device=s.device, threads=s.threads)
        self.static: EngineQueue | None = None
        self.static_drafters: dict[int, str | None] = {}

    def start(self, target: LoadedModel) -> None:
        self.target = target
        self.recorder = LoopRecorder(self.name, ray_export=True)
        self.loop = ServingLoop(self.scheduler(), observer=self.recorder.observe)
        self.progress = (0, time.monotonic())  # (steps seen, when) for check_health

    async def loop_metrics(self) -> dict[str, Any]:
        """The step loop's counters and histogram (the router's /metrics renders them)."""
        return self.recorder.snapshot().model_dump(mode="json")

    def check_health(self) -> None:
        """Serve's periodic probe: unhealthy when the step loop holds work but has not finished a
        step for `STUCK_S` (a hung kernel): Serve then replaces the replica and the router resumes
        its requests elsewhere."""
        steps, scheduler = self.recorder.snapshot().steps, self.loop.scheduler
        now = time.monotonic()
        if steps != self.progress[0] or scheduler.idle:
            self.progress = (steps, now)
        elif now - self.progress[1] > STUCK_S:
            raise RuntimeError(f"the step loop holds work but has not stepped for {now - self.progress[1]:.0f} s")

    def scheduler(self) -> Scheduler:
        """A step loop over the target (the serving one, or the static baseline's own)."""
        return Scheduler(self.target, self.settings)

    def drafter_name(self, drafter: str | None) -> str | None:
        return drafter

    async def generate(
        self, request: dict[str, Any], drafter: str | None = None, batching: Batching = "continuous"
    ) -> AsyncIterator[StreamEvent]:
        try:
            job, name = GenerationRequest.model_validate(request), self.drafter_name(drafter)
            events = self.loop.stream(job, name) if batching == "continuous" else self._static(job, name)
            first = await anext(events)
        except Overloaded as exc:
            yield StreamEvent(error=str(exc), retry_after_s=exc.retry_after_s)
            return
        except RequestError as exc:
            yield StreamEvent(error=str(exc))
            return
        yield first
        async for event in events:
            yield event

    async def _static(self, request: GenerationRequest, drafter: str | None) -> AsyncIterator[StreamEvent]:
        """The baseline: an engine queue whose batches run to completion, on a loop of its own."""
        self.loop.scheduler.check(request, drafter)
        if self.static is None:
            engine, s = self.scheduler(), self.settings

            def run(
                requests: Sequence[GenerationRequest], listeners: Sequence[TokenListener]
            ) -> list[GenerationResult]:
                return engine.generate(requests, listeners, [self.static_drafters.get(id(r)) for r in requests])

            self.static = EngineQueue(run, self.target.tokenizer, s.max_batch, s.batch_wait_ms / 1000)
        self.static_drafters[id(request)] = drafter
        try:
            async for event in self.static.submit(request):
                yield event
        finally:
            self.static_drafters.pop(id(request), None)


@serve.deployment(name="PlainBackend", ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024)
class PlainBackend(_Backend):
    name: BackendName = "plain"

    def __init__(self, settings: dict[str, Any]):
        super().__init__(settings)
        self.start(self.loaded)


@serve.deployment(name="QuantizedBackend", ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024)
class QuantizedBackend(_Backend):
    """The loop over the quantized target; with `quantized_drafters`, rows speculate where each step's
    plan finds it pays (quantization stacked with speculation), exact to the quantized model."""

    name: BackendName = "quantized"

    def __init__(self, settings: dict[str, Any]):
        super().__init__(settings)
        s = self.settings
        kinds = quantized_drafters(s.engine, s.quantized_drafters)
        if s.engine == "llamacpp":  # the builder set gguf_weights to the requantized type (quantized_args)
            target = self.loaded  # the engine's probe refuses speculation on weights whose passes vary
        else:
            method = resolve_method(self.loaded, s.quantization)
            refusal = speculation_refusal(method) if kinds else None
            if refusal:
                raise ModelLoadError(f"the quantized backend cannot speculate: {refusal}")
            # The profiler's run of the same calibration left its statistics in the cache: reused here.
            calibration = calibration_ids(self.loaded, s) if needs_calibration(method) else []
            # A method this model, dtype or device cannot take fails here, at start-up, never mid-request.
            target = quantize(self.loaded, calibration, method, calibration_cache())
            self.settings = s = drafting_settings(s, bool(kinds))
        self.drafters = [build_drafter(s.drafter.of(kind), target) for kind in kinds]
        self.names = {kind: d.name for kind, d in zip(kinds, self.drafters, strict=True)}
        if self.drafters:
            self.costs = _quantized_costs(target, s, s.k_max + 1)
            profile = served_profile(s)
            self.draft_costs = seeded_draft_costs(profile, [d.name for d in self.drafters], s.max_batch)
            # The target's per-proposal maps start the quantized model's (it agrees with the target on
            # more tokens than the quality floor); the loop corrects them per request as it serves.
            self.acceptance_maps = profile_acceptance_maps(profile)
        self.start(target)

    def scheduler(self) -> Scheduler:
        if not self.drafters:
            return super().scheduler()
        s = self.settings
        drafters = [d.fresh() for d in self.drafters]
        return Scheduler(self.target, s, drafters, "auto", s.k_max, self.costs, self.draft_costs, self.acceptance_maps)

    def drafter_name(self, drafter: str | None) -> str | None:
        """A row the policy sent without a drafter decodes plain here (it would otherwise take the
        loop's default drafter), as does one naming a drafter this backend does not load."""
        if not self.drafters:
            return None
        name = self.names.get(drafter, drafter) if drafter is not None else None
        return name if name in self.names.values() else PLAIN_ROW


@serve.deployment(name="SpeculativeBackend", ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024)
class SpeculativeBackend(_Backend):
    """One loop over every configured drafter; a request names its drafter by kind or full name
    (default: the first configured)."""

    name: BackendName = "speculative"

    def __init__(self, settings: dict[str, Any]):
        super().__init__(settings)
        s = self.settings
        self.drafters = [build_drafter(s.drafter.of(kind), self.loaded) for kind in s.drafters]
        self.names = {kind: d.name for kind, d in zip(s.drafters, self.drafters, strict=True)}
        widest = max([s.k_max + 1, *(d.widest_block for d in self.drafters)])  # a lookahead block may be wider
        self.costs = _seeded_costs(self.loaded, s, widest) or step_costs(self.loaded, widest, s)
        self.costs.ensure(s.max_batch)  # probe what the profile did not measure before any request's clock starts
        profile = served_profile(s)
        self.draft_costs = seeded_draft_costs(profile, [d.name for d in self.drafters], s.max_batch)
        self.acceptance_maps = profile_acceptance_maps(profile)
        self.start(self.loaded)

    def scheduler(self) -> Scheduler:
        s = self.settings
        drafters = [d.fresh() for d in self.drafters]  # per-sequence state of its own, weights shared
        return Scheduler(self.target, s, drafters, "auto", s.k_max, self.costs, self.draft_costs, self.acceptance_maps)

    def drafter_name(self, drafter: str | None) -> str | None:
        return self.names.get(drafter, drafter) if drafter is not None else None


def calibration_ids(loaded: LoadedModel, settings: BackendSettings) -> list[list[int]]:
    """Prompt tokens of the calibration prompts the settings carry."""
    if not settings.calibration:
        raise ModelLoadError("the quantized backend needs calibration prompts (settings.calibration): none given")
    engine = PlainEngine(loaded)
    return [engine.encode(GenerationRequest(messages=messages, max_tokens=1)) for messages in settings.calibration]


def served_profile(settings: BackendSettings) -> Profile | None:
    """The profile the builder passed in, else the file `profile` names (a single-node set-up)."""
    if settings.profile_data is not None:
        return Profile.model_validate(settings.profile_data)
    return Profile.load(Path(settings.profile)) if settings.profile else None


def _quantized_costs(target: LoadedModel, settings: BackendSettings, widest: int) -> StepCosts:
    """The quantized target's step costs: the profile's curve of it where it measured these verify
    widths (and the served method), widths it lacks probed before any request's clock starts; else
    each batch bucket probed on first use. Not at start: without its curve measured the profile is
    a first start's probe, and the policy routes nothing there until the full profile measures it
    (probing every bucket would hold up the service's first answer by half a minute here)."""
    profile = served_profile(settings)
    measured = profile.quantized if profile is not None else None
    method = gguf_method(settings.quantized_weights) if settings.engine == "llamacpp" else target.info.dtype
    if measured is None or measured.method != method or measured.curve.max_width < 2:
        return step_costs(target, widest, settings)
    costs = seeded_step_costs(target, measured.curve, settings, widest)
    costs.ensure(settings.max_batch)
    return costs


def _seeded_costs(loaded: LoadedModel, settings: BackendSettings, max_width: int = 0) -> StepCosts | None:
    """The step-cost table from the profile, so no request waits for a timing probe (widths up to
    `max_width` it did not measure are probed at start)."""
    profile = served_profile(settings)
    return None if profile is None else seeded_step_costs(loaded, profile.target, settings, max_width, profile.context)
