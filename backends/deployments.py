"""The three backends as Ray Serve deployments — thin shells: the engines do the work.

- `SpeculativeBackend`: the speculative engine, one per drafter (prompt lookup, a draft model);
  concurrent requests are batched (the engine batches rows of different lengths exactly).
- `PlainBackend`: the plain engine with dynamic batching — when the engine is free it takes every
  request waiting (up to `max_batch`; an idle engine waits `batch_wait_ms` for company); where high
  concurrency goes.
- `QuantizedBackend`: the plain engine over the int8 target (`backends.quantized`).

Each exposes `generate(request)` — an async stream of `StreamEvent`s. A request
the engine cannot serve (too long for the context, …) gets an event with `error` instead of
failing the batch it would have joined. Torch threads are set per replica: Ray starts replicas with
one, and several replicas on few cores must not oversubscribe them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from .errors import RequestError
from .generation import GenerationRequest, GenerationResult, TokenListener
from .models import LoadedModel, load_model
from .plain import PlainEngine
from .quantized import QuantMethod, quantize
from .speculative.engine import SpeculativeEngine
from .speculative.factory import DrafterConfig, DrafterKind, build_drafter
from .streaming import EngineQueue, StreamEvent

BackendName = Literal["speculative", "plain", "quantized"]
BACKENDS: tuple[BackendName, ...] = ("speculative", "plain", "quantized")


class BackendSettings(BaseModel):
    """What every backend replica is built from (the `args` of the Serve application)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("embedded", description="'embedded', a local directory, a .gguf file or a HF id")
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int = Field(1, ge=1, le=256, description="torch threads per replica")
    max_batch: int = Field(32, ge=1, le=512, description="most requests one batch takes")
    batch_wait_ms: float = Field(20.0, ge=0, le=10_000, description="how long a batch waits to fill")
    drafters: list[DrafterKind] = Field(default_factory=lambda: ["ngram", "model"], min_length=1)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="drafter options (kind ignored)")
    k_max: int = Field(8, ge=1, le=32, description="most tokens a speculative step drafts")
    quantization: QuantMethod = "smoothquant"
    profile: str | None = Field(None, description="profile JSON: seeds the speculative engine's step costs")


class _Job(BaseModel):
    """One request in a batch, with the drafter it should be speculated with (speculative only)."""

    request: GenerationRequest
    drafter: str | None = None


class _Backend:
    """Shared shell: load, validate each request alone, batch the rest through `_run`."""

    name: BackendName

    def __init__(self, settings: dict[str, Any]):
        self.settings = BackendSettings.model_validate(settings)
        s = self.settings
        self.loaded = load_model(s.model, dtype=s.dtype, device=s.device, threads=s.threads)
        self.checker = PlainEngine(self.loaded)
        self.jobs: dict[int, _Job] = {}
        self.queue = EngineQueue(self._run_requests, self.loaded.tokenizer, s.max_batch, s.batch_wait_ms / 1000)

    async def generate(self, request: dict[str, Any], drafter: str | None = None) -> AsyncIterator[StreamEvent]:
        try:
            job = _Job(request=GenerationRequest.model_validate(request), drafter=self.check_drafter(drafter))
            self.checker.encode(job.request)  # the context-length check every engine makes
        except RequestError as exc:
            yield StreamEvent(error=str(exc))
            return
        # The queue batches GenerationRequests; the drafter rides along keyed by the request object.
        self.jobs[id(job.request)] = job
        try:
            async for event in self.queue.submit(job.request):
                yield event
        finally:
            self.jobs.pop(id(job.request), None)

    def check_drafter(self, drafter: str | None) -> str | None:
        if drafter is not None:
            raise RequestError(f"the {self.name} backend does not draft: drop 'drafter' or use the speculative backend")
        return None

    def _run_requests(
        self, requests: Sequence[GenerationRequest], listeners: Sequence[TokenListener]
    ) -> list[GenerationResult]:
        return self._run([self.jobs[id(r)] for r in requests], listeners)

    def _run(self, jobs: Sequence[_Job], listeners: Sequence[TokenListener]) -> list[GenerationResult]:
        raise NotImplementedError


class _PlainShell(_Backend):
    engine: PlainEngine

    def _run(self, jobs: Sequence[_Job], listeners: Sequence[TokenListener]) -> list[GenerationResult]:
        return self.engine.generate([job.request for job in jobs], listeners)


@serve.deployment(name="PlainBackend", ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=256)
class PlainBackend(_PlainShell):
    name: BackendName = "plain"

    def __init__(self, settings: dict[str, Any]):
        super().__init__(settings)
        self.engine = PlainEngine(self.loaded)


@serve.deployment(name="QuantizedBackend", ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=256)
class QuantizedBackend(_PlainShell):
    name: BackendName = "quantized"

    def __init__(self, settings: dict[str, Any]):
        super().__init__(settings)
        self.int8 = quantize(self.loaded, calibration_ids(self.checker), self.settings.quantization)
        self.engine = PlainEngine(self.int8)


@serve.deployment(name="SpeculativeBackend", ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=64)
class SpeculativeBackend(_Backend):
    """One engine per drafter; a batch is split by drafter and the groups run one after another."""

    name: BackendName = "speculative"

    def __init__(self, settings: dict[str, Any]):
        super().__init__(settings)
        s = self.settings
        costs = _seeded_costs(self.loaded, s.profile)
        self.engines: dict[str, SpeculativeEngine] = {}
        for kind in s.drafters:
            drafter = build_drafter(s.drafter.model_copy(update={"kind": kind}), self.loaded)
            engine = SpeculativeEngine(self.loaded, drafter, k="auto", k_max=s.k_max, costs=costs)
            self.engines[kind] = self.engines[drafter.name] = engine
        self.default = s.drafters[0]

    def check_drafter(self, drafter: str | None) -> str:
        if drafter is None:
            return self.default
        if drafter not in self.engines:
            known = sorted({e.drafter.name for e in self.engines.values()} | set(self.settings.drafters))
            raise RequestError(f"unknown drafter {drafter!r}: this service drafts with {', '.join(known)}")
        return drafter

    def _run(self, jobs: Sequence[_Job], listeners: Sequence[TokenListener]) -> list[GenerationResult]:
        groups: dict[str, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.drafter or self.default, []).append(i)
        results: dict[int, GenerationResult] = {}
        for drafter, rows in groups.items():
            out = self.engines[drafter].generate([jobs[i].request for i in rows], [listeners[i] for i in rows])
            results.update(zip(rows, out, strict=True))
        return [results[i] for i in range(len(jobs))]



def calibration_ids(engine: PlainEngine) -> list[list[int]]:
    """Prompt tokens of the prompt set's calibration half (the profiler measures on the other)."""
    from profiler.workloads import quantization_split  # the prompt set lives with the profiler

    calibration, _ = quantization_split()
    return [engine.encode(GenerationRequest(messages=p.messages, max_tokens=1)) for p in calibration]


def _seeded_costs(loaded: LoadedModel, profile: str | None):
    """The step-cost table from the profile, so no request waits for a timing probe."""
    if profile is None:
        return None
    from pathlib import Path

    from policies.profile import Profile
    from profiler.profiling import seeded_step_costs

    return seeded_step_costs(loaded, Profile.load(Path(profile)).target)
