"""The Ray Serve application: the `Router` ingress (FastAPI, OpenAI routes) in front of the three
backend deployments. `app_builder` is the import path `serve run deploy/serve.yaml` and
`specroute serve` both use; the policy lives in the Router's `user_config`, so `serve deploy` with a
new policy reaches `reconfigure` without restarting anything (an invalid one is refused and the
last good policy stays; `/healthz` shows the refusal).

Metrics go through `ray.serve.metrics` (Prometheus, on Ray's metrics export port; Ray prefixes
names with `ray_`): spec-decode counters with vLLM's meaning, route decisions by backend and
stage, in-flight requests per backend, TTFT and time-per-output-token histograms.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.metrics import Counter, Gauge, Histogram

from backends.deployments import BackendSettings, PlainBackend, QuantizedBackend, SpeculativeBackend
from backends.generation import GenerationResult
from backends.models import load_tokenizer
from backends.streaming import StreamEvent
from policies.config import PolicyConfig, default_policy, load_policy
from policies.profile import Profile, ProfileError
from policies.serving_dtype import DtypeChoice
from profiler.profiling import default_profile_path
from profiler.workloads import quantization_split

from .app import create_app, install
from .core import Limits, RouterCore
from .dtype_choice import decide_dtype

log = logging.getLogger("specroute.service")
LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60]


class ServiceSettings(BaseModel):
    """The application's `args` (deploy/serve.yaml): backends, limits, profile, policy, API key."""

    model_config = ConfigDict(extra="forbid")

    backend: BackendSettings = Field(default_factory=BackendSettings)
    limits: Limits = Field(default_factory=Limits)
    profile: str | None = Field(None, description="profile JSON (default: SPECROUTE_HOME/profiles/<model>-…)")
    policy: str | None = Field(None, description="policy YAML read at start (user_config's policy overrides it)")
    api_key: str | None = Field(None, description="Bearer key clients must send; default: $SPECROUTE_API_KEY")
    router_cpus: float = Field(0.2, gt=0, description="Ray CPUs reserved for the router replica")
    backend_cpus: float = Field(0.5, gt=0, description="Ray CPUs reserved for each backend replica")
    dtype_choice: DtypeChoice | None = Field(
        None, description="set by resolve_dtype: the dtype served, with the measured reason (not for config files)"
    )

    def profile_path(self) -> Path:
        b = self.backend
        if not self.profile and b.dtype == "auto":
            raise ProfileError("the dtype is not decided yet (resolve_dtype): no profile path for dtype auto")
        return Path(self.profile) if self.profile else default_profile_path(b.model, b.dtype, b.device)

    def with_dtype(self, dtype: str) -> ServiceSettings:
        return self.model_copy(update={"backend": self.backend.model_copy(update={"dtype": dtype})})


def resolve_dtype(settings: ServiceSettings, policy: PolicyConfig | None = None) -> ServiceSettings:
    """The settings with the target's dtype decided and the reason attached (router.dtype_choice)."""
    if settings.dtype_choice is not None:
        return settings  # decided before the app was built
    b = settings.backend
    policy = policy or (load_policy(settings.policy) if settings.policy else default_policy())
    choice = decide_dtype(b.model, b.dtype, b.device, settings.profile, policy)
    return settings.with_dtype(choice.dtype).model_copy(update={"dtype_choice": choice})


class HandlePool:
    """`BackendPool` over Serve deployment handles, streaming."""

    def __init__(self, handles: dict[str, DeploymentHandle]):
        self.handles = {name: h.options(stream=True) for name, h in handles.items()}

    async def stream(
        self, backend: str, request: dict[str, Any], drafter: str | None, batching: str = "continuous"
    ) -> AsyncIterator[StreamEvent]:
        async for event in self.handles[backend].generate.remote(request, drafter, batching):
            yield event


class ServeMetrics:
    def __init__(self) -> None:
        b, d = ("backend",), ("drafter",)
        self.requests = Counter("specroute_requests", "Requests routed, by backend and stage", ("backend", "stage"))
        self.retries = Counter("specroute_retries", "Requests retried on the plain backend after a failure", b)
        self.inflight = Gauge("specroute_in_flight", "Requests in flight per backend", b)
        self.ttft = Histogram("specroute_time_to_first_token_seconds", "TTFT", LATENCY_BUCKETS, b)
        self.tpot = Histogram("specroute_time_per_output_token_seconds", "Time per output token", LATENCY_BUCKETS, b)
        self.drafts = Counter("specroute_spec_decode_num_drafts", "Steps that verified drafted tokens", d)
        self.draft_tokens = Counter("specroute_spec_decode_num_draft_tokens", "Drafted tokens verified", d)
        self.accepted = Counter("specroute_spec_decode_num_accepted_tokens", "Drafted tokens accepted", d)
        self.per_position = Counter(
            "specroute_spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by position",
            ("drafter", "position"),
        )

    def routed(self, backend: str, stage: str) -> None:
        self.requests.inc(tags={"backend": backend, "stage": stage})

    def in_flight(self, backend: str, count: int) -> None:
        self.inflight.set(count, tags={"backend": backend})

    def retried(self, backend: str) -> None:
        self.retries.inc(tags={"backend": backend})

    def finished(self, backend: str, result: GenerationResult) -> None:
        tags = {"backend": backend}
        self.ttft.observe(result.ttft_s, tags=tags)
        if result.completion_tokens > 1:
            self.tpot.observe(result.tpot_s, tags=tags)
        stats = result.speculation
        if stats is None or not stats.drafts:
            return
        drafter = {"drafter": stats.drafter}
        self.drafts.inc(stats.drafts, tags=drafter)
        self.draft_tokens.inc(stats.draft_tokens, tags=drafter)
        if stats.accepted_tokens:
            self.accepted.inc(stats.accepted_tokens, tags=drafter)
        for position, count in enumerate(stats.accepted_per_position):
            if count:
                self.per_position.inc(count, tags={**drafter, "position": str(position)})


app = create_app("")  # model id and API key are installed per replica


@serve.deployment(name="Router", ray_actor_options={"num_cpus": 0.2}, max_ongoing_requests=1024)
@serve.ingress(app)
class Router:
    def __init__(
        self,
        speculative: DeploymentHandle,
        plain: DeploymentHandle,
        quantized: DeploymentHandle,
        settings: dict[str, Any],
    ):
        s = ServiceSettings.model_validate(settings)
        profile = Profile.load(s.profile_path()).serving(s.backend.quantization)
        assert s.dtype_choice is not None  # build_app decides it before binding anything
        tokenizer = load_tokenizer(s.backend.model)
        policy = load_policy(s.policy) if s.policy else default_policy()
        pool = HandlePool({"speculative": speculative, "plain": plain, "quantized": quantized})
        self.core = RouterCore(
            profile, policy, tokenizer, pool, s.limits, ServeMetrics(), s.backend.drafters, s.dtype_choice
        )
        install(app, self.core, profile.model.name, s.api_key or os.environ.get("SPECROUTE_API_KEY") or None)

    def reconfigure(self, config: dict[str, Any]) -> None:
        """A new `user_config`: its `policy` replaces the current one if valid (kept otherwise)."""
        if config and "policy" in config:
            self.core.apply_policy(config["policy"], "user_config.policy")


def app_builder(args: dict[str, Any]) -> serve.Application:
    """The import path of deploy/serve.yaml: the application from the config's `args` (the policy
    comes through the Router's `user_config`)."""
    return build_app(args)


def build_app(args: dict[str, Any], policy: dict[str, Any] | None = None) -> serve.Application:
    """The application from `args`; `policy`, if given, becomes the Router's user_config."""
    settings = resolve_dtype(ServiceSettings.model_validate(args or {}))
    check_profile(settings)
    backend_args = settings.backend.model_dump(mode="json")
    backend_args["profile"] = backend_args["profile"] or str(settings.profile_path())
    options = {"ray_actor_options": {"num_cpus": settings.backend_cpus}}
    speculative = SpeculativeBackend.options(**options).bind(backend_args)
    plain = PlainBackend.options(**options).bind(backend_args)
    # The quantized kernels are CPU kernels over float32 weights, wherever the other backends run.
    calibration = [[m.model_dump() for m in p.messages] for p in quantization_split()[0]]
    quantized = QuantizedBackend.options(**options).bind(
        {**backend_args, "device": "cpu", "dtype": "float32", "calibration": calibration}
    )
    router_options: dict[str, Any] = {"ray_actor_options": {"num_cpus": settings.router_cpus}}
    if policy is not None:
        router_options["user_config"] = {"policy": policy}
    router = Router.options(**router_options)
    return router.bind(speculative, plain, quantized, settings.model_dump(mode="json"))


def check_profile(settings: ServiceSettings) -> Profile:
    """Refuse to start on a missing profile or one of another model, with what to do instead."""
    path = settings.profile_path()
    profile = Profile.load(path)
    model = settings.backend.model
    if model in ("embedded", "default"):
        from backends.embedded import EMBEDDED_NAME

        model = EMBEDDED_NAME
    if profile.model.name != model:
        raise ProfileError(f"{path} profiles {profile.model.name}, not {model}: profile this model first")
    return profile.serving(settings.backend.quantization)
