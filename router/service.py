"""The Ray Serve application: the `Router` ingress (FastAPI, OpenAI routes) in front of the three
backend deployments. `app_builder` is the import path `serve run deploy/serve.yaml` and
`specroute serve` both use; the policy lives in the Router's `user_config`, so `serve deploy` with a
new policy reaches `reconfigure` without restarting anything (an invalid one is refused and the
last good policy stays; `/healthz` shows the refusal).

Metrics (`router.metrics`): `GET /metrics` on the service's own port serves them in Prometheus text
format — the router's counters and histograms and each backend's step loop, fetched from its replica
per scrape — and the same series also go through `ray.serve.metrics` to Ray's metrics export port
(Ray prefixes names with `ray_`), which aggregates every replica of a cluster.

Across nodes: the builder reads the profile once and passes it to every replica in its arguments,
and a replica on a node without the embedded model sets it up there (`ensure_model_here`), so a
replica needs nothing from the head node's disk.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from backends.deployments import BackendSettings, PlainBackend, QuantizedBackend, SpeculativeBackend
from backends.embedded import ensure_model_here
from backends.engines import caches_exactly
from backends.engines.llamacpp import llama_unavailable
from backends.loop_metrics import LoopSnapshot
from backends.models import load_tokenizer
from backends.streaming import StreamEvent
from policies.config import PolicyConfig, default_policy, load_policy
from policies.engines import EngineName, default_drafters, gguf_method, quantized_drafters
from policies.prefix import BLOCK_TOKENS
from policies.profile import Profile, ProfileError
from policies.replicas import ReplicaRouting
from policies.serving_dtype import DEFAULT_DTYPE, DtypeChoice, choose_engine
from profiler.profiling import default_profile_path
from profiler.workloads import quantization_split

from .app import create_app, install
from .core import PREFIX_BACKENDS, Limits, RouterCore
from .dtype_choice import decide_dtype
from .metrics import ServiceMetrics
from .replica_registry import replica_counts
from .replica_router import AffinityRouter

log = logging.getLogger("specroute.service")
DEPLOYMENTS = {"speculative": "SpeculativeBackend", "plain": "PlainBackend", "quantized": "QuantizedBackend"}
SNAPSHOT_TIMEOUT_S = 2.0


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
    replicas: int = Field(1, ge=1, le=256, description="replicas of each backend deployment")
    replica_routing: ReplicaRouting = Field(
        default_factory=ReplicaRouting, description="how requests spread over the replicas of one backend"
    )
    dtype_choice: DtypeChoice | None = Field(
        None, description="set by resolve_dtype: the dtype served, with the measured reason (not for config files)"
    )
    profile_data: dict[str, Any] | None = Field(
        None, description="set by build_app: the profile itself, passed to replicas on any node (not for config files)"
    )

    def fitted_to(self, cpus: int) -> ServiceSettings:
        """These settings with each backend replica's Ray CPUs lowered, if need be, so the router and
        every replica fit on `cpus` (one machine: `specroute serve`); Ray would leave the rest pending."""
        fits = (cpus - self.router_cpus) / (len(DEPLOYMENTS) * self.replicas)
        if self.backend_cpus <= fits:
            return self
        return self.model_copy(update={"backend_cpus": max(math.floor(fits * 1000) / 1000, 0.001)})

    def profile_path(self) -> Path:
        b = self.backend
        if not self.profile and (b.engine == "auto" or (b.engine == "torch" and b.dtype == "auto")):
            raise ProfileError("the engine and dtype are not decided yet (resolve_dtype): no profile path for auto")
        return Path(self.profile) if self.profile else default_profile_path(b.model, b.dtype, b.device, b)

    def with_dtype(self, dtype: str) -> ServiceSettings:
        return self.model_copy(update={"backend": self.backend.model_copy(update={"dtype": dtype})})

    def with_engine(self, engine: EngineName) -> ServiceSettings:
        """These settings on `engine`, with its default drafters unless the settings named some."""
        b = self.backend
        update: dict[str, Any] = {"engine": engine}
        if "drafters" not in b.model_fields_set:
            update["drafters"] = default_drafters(engine)
        return self.model_copy(update={"backend": b.model_copy(update=update)})


def resolve_dtype(settings: ServiceSettings, policy: PolicyConfig | None = None) -> ServiceSettings:
    """The settings with the target's dtype decided and the reason attached (router.dtype_choice)."""
    if settings.dtype_choice is not None:
        return settings  # decided before the app was built
    b = settings.backend
    policy = policy or (load_policy(settings.policy) if settings.policy else default_policy())
    if b.engine == "auto":
        return _resolve_engine(settings, policy)
    if b.engine == "llamacpp":  # its passes run the GGUF weights; the torch model only drafts and tokenizes
        return settings.with_dtype(DEFAULT_DTYPE).model_copy(update={"dtype_choice": llamacpp_dtype(b)})
    choice = decide_dtype(b.model, b.dtype, b.device, settings.profile, policy)
    return settings.with_dtype(choice.dtype).model_copy(update={"dtype_choice": choice})


def _resolve_engine(settings: ServiceSettings, policy: PolicyConfig) -> ServiceSettings:
    """Engine auto: a given profile's engine, else torch's dtype choice against the llama.cpp
    engine's profile (`policies.serving_dtype.choose_engine`)."""
    if settings.profile:
        engine = Profile.load(Path(settings.profile)).model.engine
        return resolve_dtype(settings.with_engine(engine), policy)
    torch = resolve_dtype(settings.with_engine("torch"), policy)
    llama = settings.with_engine("llamacpp")
    path = llama.profile_path()
    missing = llama_unavailable() or f"no profile of it here ({path}; `specroute profile --engine llamacpp`)"
    profile = Profile.load(path) if path.is_file() else None
    assert torch.dtype_choice is not None
    choice = choose_engine(torch.dtype_choice, profile, policy, missing)
    chosen = llama.with_dtype(DEFAULT_DTYPE) if choice.engine == "llamacpp" else torch
    return chosen.model_copy(update={"dtype_choice": choice})


def llamacpp_dtype(backend: BackendSettings) -> DtypeChoice:
    """What a llama.cpp service's replicas load torch's copy of the target in (its drafters and
    the tokenizer read it; no target pass runs on it), and why."""
    return DtypeChoice(
        dtype=DEFAULT_DTYPE,
        engine="llamacpp",
        source="configured",
        reason=f"engine llamacpp: the target's passes run llama.cpp on the GGUF weights ({backend.gguf_weights}); "
        f"torch's {DEFAULT_DTYPE} copy serves the drafters and tokenizer only",
    )


def quantization_served(backend: BackendSettings) -> str:
    """The quantized backend's method as the profile names it: torch's `quantization`, or on the
    llama.cpp engine the file requantized to `quantized_weights`."""
    if backend.engine == "llamacpp":
        return gguf_method(backend.quantized_weights)
    return backend.quantization


def prefix_blocks(settings: ServiceSettings, backend: str = "plain") -> int:
    """KV blocks a replica of `backend` may keep as prefix cache: float32 torch targets cache
    (backends.engines.caches_exactly), the quantized backend's int kernels and llama.cpp do not yet."""
    b, choice = settings.backend, settings.dtype_choice
    caching = b.prefix_caching and b.engine == "torch" and choice is not None and caches_exactly(choice.dtype)
    return b.cache_tokens // BLOCK_TOKENS if caching and backend in PREFIX_BACKENDS else 0


def replica_router(settings: ServiceSettings, backend: str) -> RequestRouterConfig:
    """How a backend deployment's handles pick its replica (`router.replica_router`)."""
    kwargs = {"prefix_blocks": prefix_blocks(settings, backend), **settings.replica_routing.model_dump()}
    path = f"{AffinityRouter.__module__}.{AffinityRouter.__qualname__}"  # imported where the handle runs
    return RequestRouterConfig(request_router_class=path, request_router_kwargs=kwargs)


class HandlePool:
    """`BackendPool` over Serve deployment handles, streaming; `ObservedPool` through Serve's
    controller (which replicas live) and each backend's `loop_metrics`."""

    def __init__(self, handles: dict[str, DeploymentHandle], app_name: str):
        self.unary = handles  # for calls that return one value (loop_metrics)
        self.handles = {name: h.options(stream=True) for name, h in handles.items()}
        self.app_name = app_name

    async def health(self) -> dict[str, str | None]:
        """Each backend's problem, as Serve's controller sees its replicas (None: one is running)."""
        try:
            status = await asyncio.to_thread(serve.status)
        except Exception as exc:  # the controller itself is unreachable: nothing is known to be live
            return {name: f"Serve's controller did not answer ({type(exc).__name__})" for name in self.handles}
        app = status.applications.get(self.app_name)
        deployments = app.deployments if app is not None else {}
        return {name: _replica_problem(deployments.get(DEPLOYMENTS[name])) for name in self.handles}

    def replica_counts(self) -> dict[str, int]:
        """Running replicas per backend, as this process's handles route over them (absent: not yet known)."""
        counts = replica_counts()
        return {name: counts[d] for name, d in DEPLOYMENTS.items() if d in counts}

    async def loop_snapshots(self) -> list[LoopSnapshot]:
        """Each backend's step-loop snapshot; a backend that does not answer within
        `SNAPSHOT_TIMEOUT_S` (restarting, or no replica) is left out of this scrape."""

        async def one(handle: DeploymentHandle) -> LoopSnapshot | None:
            try:
                data = await asyncio.wait_for(handle.loop_metrics.remote(), SNAPSHOT_TIMEOUT_S)
            except Exception:
                return None
            return LoopSnapshot.model_validate(data)

        found = await asyncio.gather(*(one(h) for h in self.unary.values()))
        return [s for s in found if s is not None]

    async def stream(
        self, backend: str, request: dict[str, Any], drafter: str | None, batching: str = "continuous"
    ) -> AsyncIterator[StreamEvent]:
        async for event in self.handles[backend].generate.remote(request, drafter, batching):
            yield event


def _replica_problem(deployment: Any) -> str | None:
    if deployment is None:
        return "not deployed"
    running = deployment.replica_states.get("RUNNING", 0)
    return None if running else f"no running replica (Serve reports {deployment.status}: {deployment.message or '-'})"


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
        assert s.dtype_choice is not None and s.profile_data is not None  # build_app decides both first
        self.quantization = quantization_served(s.backend)
        self.stacked = quantized_drafters(s.backend.engine, s.backend.quantized_drafters)  # type: ignore[arg-type]
        profile = Profile.model_validate(s.profile_data).serving(self.quantization, self.stacked)
        ensure_model_here(s.backend.model)  # the tokenizer comes with the model
        tokenizer = load_tokenizer(s.backend.model)
        policy = load_policy(s.policy) if s.policy else default_policy()
        handles = {"speculative": speculative, "plain": plain, "quantized": quantized}
        pool = HandlePool(handles, serve.get_replica_context().app_name)
        b = s.backend
        self.core = RouterCore(
            profile, policy, tokenizer, pool, s.limits, ServiceMetrics(), b.drafters, s.dtype_choice, prefix_blocks(s)
        )
        install(app, self.core, profile.model.name, s.api_key or os.environ.get("SPECROUTE_API_KEY") or None)

    def check_health(self) -> None:
        """Serve's periodic probe: this replica's app must serve this replica's core (the route
        handlers find it through `install`)."""
        if getattr(app.state, "core", None) is not self.core:
            raise RuntimeError("the HTTP app does not serve this replica's router core")

    def reconfigure(self, config: dict[str, Any]) -> None:
        """A new `user_config`: its `policy` replaces the current one if valid (kept otherwise); its
        `profile`, a profile file on this node, replaces the profile the replica started with (how
        `specroute serve` swaps in the full profile once measured; a bad one is refused likewise)."""
        if config and "policy" in config:
            self.core.apply_policy(config["policy"], "user_config.policy")
        if config and config.get("profile"):
            self.core.apply_profile(Path(config["profile"]), self.quantization, self.stacked)

    def in_flight(self) -> int:
        """Requests this replica is running (`specroute serve` pauses its background profiler while any are)."""
        return sum(self.core.load.values())


def app_builder(args: dict[str, Any]) -> serve.Application:
    """The import path of deploy/serve.yaml: the application from the config's `args` (the policy
    comes through the Router's `user_config`)."""
    return build_app(args)


def build_app(args: dict[str, Any], policy: dict[str, Any] | None = None) -> serve.Application:
    """The application from `args`; `policy`, if given, becomes the Router's user_config."""
    settings = resolve_dtype(ServiceSettings.model_validate(args or {}))
    profile = check_profile(settings)
    # Read once here and carried in every replica's arguments: no replica reads the file.
    settings = settings.model_copy(update={"profile_data": profile.model_dump(mode="json")})
    backend_args = settings.backend.model_dump(mode="json")
    backend_args["profile"] = backend_args["profile"] or str(settings.profile_path())
    backend_args["profile_data"] = settings.profile_data

    def options(backend: str) -> dict[str, Any]:
        return {
            "ray_actor_options": {"num_cpus": settings.backend_cpus},
            "num_replicas": settings.replicas,
            "request_router_config": replica_router(settings, backend),
        }

    speculative = SpeculativeBackend.options(**options("speculative")).bind(backend_args)
    plain = PlainBackend.options(**options("plain")).bind(backend_args)
    quantized = QuantizedBackend.options(**options("quantized")).bind(quantized_args(settings.backend, backend_args))
    router_options: dict[str, Any] = {"ray_actor_options": {"num_cpus": settings.router_cpus}}
    if policy is not None:
        router_options["user_config"] = {"policy": policy}
    router = Router.options(**router_options)
    return router.bind(speculative, plain, quantized, settings.model_dump(mode="json"))


def quantized_args(backend: BackendSettings, backend_args: dict[str, Any]) -> dict[str, Any]:
    """The quantized backend's settings: on torch, CPU kernels over float32 weights (wherever the
    other backends run) and the calibration prompts; on llama.cpp, the file requantized."""
    if backend.engine == "llamacpp":
        return {**backend_args, "gguf_weights": backend.quantized_weights}
    calibration = [[m.model_dump() for m in p.messages] for p in quantization_split()[0]]
    return {**backend_args, "device": "cpu", "dtype": "float32", "calibration": calibration}


def check_profile(settings: ServiceSettings, policy: PolicyConfig | None = None) -> Profile:
    """The profile as read (not yet narrowed to the served quantization); refuse to start on a
    missing profile, one of another model, engine or weights, one without the served method, or
    llama.cpp weights measured under the policy's quality floor, saying what to do."""
    path = settings.profile_path()
    profile = Profile.load(path)
    b, model = settings.backend, settings.backend.model
    if model in ("embedded", "default"):
        from backends.embedded import EMBEDDED_NAME

        model = EMBEDDED_NAME
    if profile.model.name != model:
        raise ProfileError(f"{path} profiles {profile.model.name}, not {model}: profile this model first")
    weights = b.gguf_weights if b.engine == "llamacpp" else None
    if (profile.model.engine, profile.model.gguf_weights) != (b.engine, weights):
        raise ProfileError(
            f"{path} profiles {profile.model.served} on {profile.model.engine}; the service runs {b.engine}"
            f"{f' with weights {weights}' if weights else ''}: profile that (`specroute profile --engine {b.engine}`)"
        )
    profile.serving(quantization_served(b))  # refuses an unmeasured method
    _check_quality(profile, policy or (load_policy(settings.policy) if settings.policy else default_policy()))
    return profile


def _check_quality(profile: Profile, policy: PolicyConfig) -> None:
    """llama.cpp weights are a numerical model of their own: served only if their measured quality
    against the float target meets the floor the quantized backend is held to."""
    quality = profile.model.quality
    if quality is None or policy.quantization.meets_floor(quality.agreement):
        return
    raise ProfileError(
        f"{profile.model.served} agrees with the float target on {quality.agreement:.1%} of held-out tokens, under "
        f"the policy's floor ({policy.quantization.min_agreement:.0%}): serve other weights (--gguf-weights), the "
        "torch engine, or lower quantization.min_agreement"
    )
