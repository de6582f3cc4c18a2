"""The router's logic, free of Ray and HTTP: check a request against the limits, decide where it
goes (the policy, fed with live in-flight counts, the α predictor and the profile), run it on a
backend with retry, count what is in flight, and feed the α each request achieved back to the
predictor. `router.service` plugs in Ray Serve handles; tests plug in engines or fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from backends.errors import Overloaded, RequestError
from backends.generation import GenerationRequest, GenerationResult
from backends.loop_metrics import LoopSnapshot
from backends.plain import prompt_ids
from backends.streaming import StreamEvent
from policies.calibration import ServiceCalibration, predicted_tpot_ms, predicted_ttft_ms
from policies.config import PolicyConfig, PolicyError, parse_policy
from policies.estimates import BACKENDS, ProfileCosts
from policies.policy import Decision, LoadSnapshot, RequestFeatures, decide, k_range
from policies.profile import Profile, ProfileError
from policies.serving_dtype import DtypeChoice

from .advise import Predictors, request_features
from .metrics import ServiceMetrics
from .prefix_index import PrefixIndex
from .schemas import SpecrouteInfo, SpecrouteOptions

log = logging.getLogger("specroute.router")
PREFIX_BACKENDS = ("speculative", "plain")  # the backends whose replicas keep a prefix cache (not quantized's kernels)


class Limits(BaseModel):
    """What one request may ask for; beyond these it gets a 400 that names the limit."""

    model_config = ConfigDict(extra="forbid")

    max_prompt_tokens: int = Field(4096, ge=1)
    max_tokens: int = Field(
        4096,
        ge=1,
        description="largest max_tokens a request may ask for (KV memory is taken as tokens are produced: asking "
        "for more than an answer uses costs nothing)",
    )
    default_max_tokens: int = Field(256, ge=1, description="a chat request without max_tokens gets this")
    max_messages: int = Field(128, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    retries: int = Field(
        3, ge=0, le=10, description="attempts after a backend fails (on a backend giving the same tokens)"
    )
    quantized_wait_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="how long a request whose quantized replica died waits for a new one (Serve restarts it) "
        "before it finishes on plain, whose full-precision tokens differ",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="most seconds a client may take to send its request body (else 408)"
    )


class BackendPool(Protocol):
    def stream(
        self, backend: str, request: dict[str, Any], drafter: str | None, batching: str = "continuous"
    ) -> AsyncIterator[StreamEvent]: ...


@runtime_checkable
class ObservedPool(Protocol):
    """A pool that can say whether each backend has a live replica and how its step loop runs
    (the Serve handles can; in-process test pools need not)."""

    async def health(self) -> dict[str, str | None]:
        """Each backend's problem (None: it has a live replica)."""
        ...

    async def loop_snapshots(self) -> list[LoopSnapshot]: ...


@runtime_checkable
class ReplicatedPool(Protocol):
    """A pool whose backends may run several replicas each (the Serve handles)."""

    def replica_counts(self) -> dict[str, int]:
        """Running replicas per backend (absent: one, or not known yet)."""
        ...


class Metrics(Protocol):
    def routed(self, backend: str, stage: str) -> None: ...
    def in_flight(self, backend: str, count: int) -> None: ...
    def finished(self, backend: str, result: GenerationResult) -> None: ...
    def retried(self, backend: str) -> None: ...
    def render(self, snapshots: list[LoopSnapshot]) -> tuple[bytes, str]: ...


@dataclass
class Prepared:
    request: GenerationRequest
    prompt_tokens: int
    options: SpecrouteOptions
    prompt_ids: list[int]


@dataclass
class Routed:
    backend: str
    drafter: str | None
    k: int | None
    stage: str
    reasons: list[str]
    concurrency: int
    predicted_alpha: float | None
    decision: Decision
    features: RequestFeatures
    weights: str = "float32"  # the serving backend's dtype, or its quantization method
    retried: bool = False

    def info(self, result: GenerationResult | None) -> SpecrouteInfo:
        stats = result.speculation if result is not None else None
        return SpecrouteInfo(
            backend=self.backend,
            drafter=self.drafter,
            k=self.k,
            stage=self.stage,
            reasons=self.reasons,
            concurrency=self.concurrency,
            predicted_alpha=self.predicted_alpha,
            alpha=stats.alpha if stats and stats.judged_tokens else None,
            accepted_tokens=stats.accepted_tokens if stats else None,
            draft_tokens=stats.draft_tokens if stats else None,
            mean_accepted_length=stats.mean_accepted_length if stats and stats.drafts else None,
            retried=self.retried,
            weights=self.weights,
            ttft_ms=result.ttft_s * 1e3 if result else None,
            tpot_ms=result.tpot_s * 1e3 if result else None,
        )


class RouterCore:
    def __init__(
        self,
        profile: Profile,
        policy: PolicyConfig,
        tokenizer: PreTrainedTokenizerBase,
        pool: BackendPool,
        limits: Limits | None = None,
        metrics: Metrics | None = None,
        served_drafters: list[str] | None = None,
        dtype_choice: DtypeChoice | None = None,
        prefix_blocks: int = 0,
        prefix_backends: tuple[str, ...] = PREFIX_BACKENDS,
    ):
        """`served_drafters`: the drafter kinds the speculative backend loaded (None: any profiled);
        `dtype_choice`: the dtype the backends run in and why (None: the profile's, as given);
        `prefix_blocks`: KV blocks one backend's prefix cache may hold (0: the backends cache none), for
        `prefix_backends` (the quantized target's int kernels keep no prefix cache)."""
        self.profile, self.policy, self.tokenizer, self.pool = profile, policy, tokenizer, pool
        self.dtype_choice = dtype_choice or DtypeChoice(
            dtype=profile.model.dtype, source="configured", reason=f"{profile.model.dtype}: the profile's dtype"
        )
        self.served_drafters = served_drafters
        self.limits = limits or Limits()
        self.metrics = metrics or ServiceMetrics(ray_export=False)
        self.predictors = Predictors.from_profile(profile)
        self.load: Counter[str] = Counter()
        self.prefixes = PrefixIndex(prefix_blocks, prefix_backends)
        self.calibration = ServiceCalibration(policy.calibration)
        self.policy_error: str | None = None
        self.profile_error: str | None = None

    @property
    def drafters(self) -> list[str]:
        """Names and kinds of the drafters profiled and served: what a request may ask for."""
        served = [d for d in self.profile.drafters if self.served_drafters is None or d.kind in self.served_drafters]
        return sorted({d.name for d in served} | {d.kind for d in served})

    def effective_policy(self) -> PolicyConfig:
        """The policy, its drafters narrowed to those the speculative backend serves."""
        spec = self.policy.speculation
        if self.served_drafters is None:
            return self.policy
        kept = [d for d in spec.drafters if d in self.served_drafters]
        if kept == list(spec.drafters):
            return self.policy
        update = {"drafters": kept} if kept else {"drafters": [], "enabled": False}
        return self.policy.model_copy(update={"speculation": spec.model_copy(update=update)})

    # -- policy ---------------------------------------------------------------------------------
    def apply_policy(self, raw: dict[str, Any] | None, source: str = "user_config") -> bool:
        """Swap in a new policy; an invalid one is refused and the last good one stays."""
        try:
            self.policy = parse_policy(raw or {}, source)
        except PolicyError as exc:
            self.policy_error = str(exc)
            log.error("policy rejected, keeping the last good one: %s", exc)
            return False
        self.policy_error = None
        self.calibration.config = self.policy.calibration
        return True

    def apply_profile(self, path: Path, quantization: str = "auto", stacked: list[str] | None = None) -> bool:
        """Route with the profile at `path` from now on (the full measurement replacing a
        provisional one), served with the quantized method `quantization` speculating with the
        drafter kinds `stacked` (None: as measured); one that cannot be read or profiles another
        model or dtype is refused and the current one stays."""
        try:
            profile = Profile.load(path).serving(quantization, stacked)
            now, new = self.profile.model, profile.model
            if (new.name, new.served) != (now.name, now.served):
                raise ProfileError(
                    f"{path} profiles {new.name} in {new.served}, the service runs {now.name} in {now.served}"
                )
        except ProfileError as exc:
            self.profile_error = str(exc)
            log.error("profile rejected, keeping the current one: %s", exc)
            return False
        if profile.samples != self.profile.samples:  # the same samples: keep what the predictors learned since
            self.predictors = Predictors.from_profile(profile)
        self.calibration.clear()  # factors over the old profile's predictions say nothing about the new one's
        self.profile, self.profile_error = profile, None
        log.info("routing with the profile at %s (measured %s)", path, profile.created)
        return True

    # -- admission ------------------------------------------------------------------------------
    def prepare(self, request: GenerationRequest, options: SpecrouteOptions, messages: int = 1) -> Prepared:
        limits = self.limits
        if messages > limits.max_messages:
            raise RequestError(f"{messages} messages exceed this service's limit of {limits.max_messages}")
        if request.max_tokens > limits.max_tokens:
            raise RequestError(
                f"max_tokens {request.max_tokens} exceeds this service's limit of {limits.max_tokens}: lower it"
            )
        ids = prompt_ids(self.tokenizer, request)
        tokens = len(ids)
        if tokens > limits.max_prompt_tokens:
            raise RequestError(
                f"the prompt has {tokens} tokens, over this service's limit of {limits.max_prompt_tokens}: shorten it"
            )
        if options.drafter is not None and options.drafter not in self.drafters:
            raise RequestError(f"unknown drafter {options.drafter!r}: use one of {', '.join(self.drafters)} or omit it")
        if options.category is not None and options.category not in self.profile.categories:
            raise RequestError(
                f"unknown category {options.category!r}: use one of {', '.join(self.profile.categories)} or omit it"
            )
        # The backends feed these ids (the prompt is tokenized once, here) and the replica router reads them.
        return Prepared(request.model_copy(update={"prompt_ids": ids}), tokens, options, ids)

    # -- routing --------------------------------------------------------------------------------
    def decide(self, prepared: Prepared, extra_load: int = 0, explain: bool = True) -> tuple[Decision, RequestFeatures]:
        """The policy's decision for this request at the live load; `explain`: with each drafter's
        break-even concurrency (advice shows it; routing skips its cost)."""
        try:
            features = request_features(
                prepared.request,
                prepared.options.category,
                self.profile,
                self.predictors,
                self.tokenizer,
                prepared.request.max_tokens,
                prepared.prompt_ids,
            )
        except ProfileError as exc:
            raise RequestError(str(exc)) from None
        cached = self.prefixes.cached(prepared.prompt_ids, prepared.request.cache_salt)
        features = features.model_copy(update={"cached_tokens": cached})
        in_flight = {b: n for b, n in self.load.items() if n}
        if extra_load:
            in_flight["other"] = extra_load
        replicas = self.pool.replica_counts() if isinstance(self.pool, ReplicatedPool) else {}
        snapshot = LoadSnapshot(in_flight=in_flight, replicas=replicas)
        policy = self.effective_policy()
        calibration = None  # measured either way; read only where the policy applies it
        if policy.calibration.enabled:
            calibration = self.calibration.at(policy.concurrency_override or snapshot.concurrency, BACKENDS)
        decision = decide(features, snapshot, self.profile, policy, break_even=explain, calibration=calibration)
        return decision, features

    def route(self, prepared: Prepared) -> Routed:
        decision, features = self.decide(prepared, explain=False)
        forced = prepared.options.backend
        backend, drafter, k, stage = decision.backend, decision.drafter, decision.k, decision.stage
        reasons = list(decision.reasons)
        if forced != "auto":
            provisional = [why for why in [self.profile.provisional_reason()] if why]
            reasons = [
                *provisional,
                f"forced: the request asked for the {forced} backend (the policy would pick {backend})",
            ]
            backend, stage = forced, "forced"
            drafter, k = (None, None) if forced != "speculative" else self._forced_drafter(decision, prepared)
        elif backend == "speculative" and prepared.options.drafter:
            drafter = self.profile.drafter(prepared.options.drafter).name
        alpha = features.alphas.get(drafter).alpha if drafter in features.alphas else None
        if backend == "quantized" and drafter is not None:  # the quantized model's own α, as the policy read it
            alpha = decision.chosen().alpha
        return Routed(
            backend, drafter, k, stage, reasons, decision.concurrency, alpha, decision, features, self.weights(backend)
        )

    def weights(self, backend: str) -> str:
        """What a backend's target computes in: the served dtype, or the quantized backend's method."""
        if backend != "quantized":
            engine = self.profile.model
            return engine.served if engine.engine != "torch" else self.dtype_choice.dtype
        quantized = self.profile.quantized
        return quantized.method if quantized is not None else "quantized (method not profiled yet)"

    def _forced_drafter(self, decision: Decision, prepared: Prepared) -> tuple[str | None, int | None]:
        if prepared.options.drafter:
            return self.profile.drafter(prepared.options.drafter).name, None
        specs = [c for c in decision.candidates if c.backend == "speculative"]
        best = max(specs, key=lambda c: c.speedup, default=None)
        return (best.drafter, best.k) if best else (None, None)

    # -- running --------------------------------------------------------------------------------
    async def run(self, prepared: Prepared, routed: Routed) -> AsyncIterator[StreamEvent]:
        """The request's events; a backend failing mid-request is retried (`_failover`), resuming
        after the tokens already produced, so an accepted request is never lost or changed."""
        self.metrics.routed(routed.backend, routed.stage)
        sent: list[int] = []
        backend, drafter = routed.backend, routed.drafter
        attempts, failed_at = 0, None
        while True:
            request = self._resumed(prepared.request, sent)
            self.prefixes.sent(backend, prepared.prompt_ids, prepared.request.cache_salt)
            try:
                events = self._tracked(backend, request, drafter, prepared.options.batching)
                async with contextlib.aclosing(events):  # leaving early releases the backend's in-flight count
                    async for event in events:
                        if event.error and event.retry_after_s is not None:
                            overloaded = Overloaded(event.error, event.retry_after_s)
                            if sent or routed.retried or routed.stage == "forced":
                                raise overloaded
                            backend, drafter = self._next_best(routed, backend, overloaded)
                            break  # the full backend started nothing: the next-best one serves the request
                        if event.error:
                            raise RequestError(event.error)
                        sent += event.token_ids
                        if event.result is not None:
                            event = event.model_copy(update={"result": self._whole(event.result, prepared, sent)})
                            self._learn(prepared, routed, event.result)
                            self.metrics.finished(routed.backend, event.result)
                        yield event
                    else:
                        return
            except (RequestError, asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # a replica died or an engine failed: retry elsewhere
                attempts += 1
                failed_at = failed_at or time.monotonic()  # the wait for a new replica counts from here
                waiting = self._failover(backend, failed_at) == backend
                if attempts > self.limits.retries and not waiting:
                    raise
                log.warning("backend %s failed (%s: %s); retrying", backend, type(exc).__name__, exc)
                self.metrics.retried(backend)
                routed.retried = True
                backend, drafter = self._failover(backend, failed_at), None
                routed.weights = self.weights(backend)
                await asyncio.sleep(min(0.2 * 2 ** (attempts - 1), 2.0))

    def _next_best(self, routed: Routed, full: str, overloaded: Overloaded) -> tuple[str, str | None]:
        """Where a request goes when its backend answered 429 before starting it: the candidate
        with the lowest predicted latency on another backend the policy may use (the quantized one
        only above the quality floor); else the 429 stands."""
        policy, quantized = self.effective_policy(), self.profile.quantized
        usable = {"speculative", "plain"}
        q = policy.quantization
        if q.enabled and quantized is not None and q.meets_floor(quantized.agreement):
            usable.add("quantized")
        others = [c for c in routed.decision.candidates if c.backend != full and c.backend in usable]
        best = min(others, key=lambda c: c.latency_ms, default=None)
        if best is None:
            raise overloaded
        routed.reasons.append(
            f"retried: the {full} backend was full ({overloaded}); the next-best candidate is {best.backend}"
            + (f" with {best.drafter}" if best.drafter else "")
            + f" (predicted {best.latency_ms:.0f} ms)"
        )
        routed.retried, routed.backend, routed.drafter = True, best.backend, best.drafter
        routed.k = best.k if best.drafter else None
        routed.weights = self.weights(best.backend)
        self.metrics.retried(full)
        return best.backend, best.drafter

    def _failover(self, failed: str, since: float) -> str:
        """Where a failed attempt goes next. Speculative and plain decoding give the same tokens,
        so each stands in for the other; the quantized backend's tokens are its own, so its request
        waits (`quantized_wait_s` from its first failure, `since`) for Serve to restart a quantized
        replica before it finishes on plain in full precision."""
        if failed == "plain":
            return "speculative"
        if failed == "quantized" and time.monotonic() - since < self.limits.quantized_wait_s:
            return "quantized"
        return "plain"

    async def _tracked(self, backend: str, request: GenerationRequest, drafter: str | None, batching: str):
        self.load[backend] += 1
        self.metrics.in_flight(backend, self.load[backend])
        try:
            async for event in self.pool.stream(backend, request.model_dump(mode="json"), drafter, batching):
                yield event
        finally:
            self.load[backend] -= 1
            self.metrics.in_flight(backend, self.load[backend])

    @staticmethod
    def _resumed(request: GenerationRequest, sent: list[int]) -> GenerationRequest:
        if not sent:
            return request
        left = request.max_tokens - len(sent)
        return request.model_copy(update={"resume_ids": list(sent), "max_tokens": max(left, 1)})

    def _whole(self, result: GenerationResult, prepared: Prepared, sent: list[int]) -> GenerationResult:
        """After a resume the last attempt's result covers only its own tokens: widen it back."""
        if len(result.token_ids) == len(sent):
            return result
        text = self.tokenizer.decode(sent[: len(sent) - len(result.token_ids)], skip_special_tokens=True)
        return result.model_copy(
            update={
                "text": text + result.text,
                "token_ids": list(sent),
                "completion_tokens": len(sent),
                "prompt_tokens": prepared.prompt_tokens,
                # the resumed attempt's prompt held the tokens already sent: only the client's prompt counts
                "cached_tokens": min(result.cached_tokens, prepared.prompt_tokens),
            }
        )

    def _learn(self, prepared: Prepared, routed: Routed, result: GenerationResult) -> None:
        """What a finished request measured corrects the router: its time per token the backend's
        calibration factor at its load, its α and ρ the predictors for its drafter (and category)."""
        self._calibrate(prepared, routed, result)
        self._learn_acceptance(prepared, routed, result)

    def _calibrate(self, prepared: Prepared, routed: Routed, result: GenerationResult) -> None:
        """The request's measured time per token over what the profile predicts for it (at the
        acceptance it achieved), and its time to first token over the profile's prefill of the
        prompt tokens its backend did not hold cached. A retried request's times mix two backends
        and are left out."""
        if routed.retried or result.completion_tokens < 2 or result.tpot_s <= 0:
            return
        stats = result.speculation
        drafter = stats.drafter if stats is not None else routed.drafter
        achieved = (stats.alpha, stats.proposal_rate) if stats is not None else None
        policy = self.effective_policy()
        predicted = predicted_tpot_ms(
            self.profile,
            routed.backend,
            drafter,
            routed.concurrency,
            prepared.prompt_tokens,
            result.completion_tokens,
            k_range(ProfileCosts(self.profile), policy),
            achieved,
        )
        if predicted is not None:
            self.calibration.observe("tpot", routed.backend, routed.concurrency, predicted, result.tpot_s * 1e3)
        cached = min(result.cached_tokens, prepared.prompt_tokens)
        ttft = predicted_ttft_ms(self.profile, routed.backend, routed.concurrency, prepared.prompt_tokens, cached)
        if ttft is not None:
            self.calibration.observe("ttft", routed.backend, routed.concurrency, ttft, result.ttft_s * 1e3)

    def _learn_acceptance(self, prepared: Prepared, routed: Routed, result: GenerationResult) -> None:
        """The α and ρ this request achieved correct the predictors for its drafter (and category):
        α from accepted of judged tokens, ρ from drafts of the steps that asked for them (a request
        whose drafter never proposed still says ρ was 0, though it judged nothing)."""
        stats = result.speculation
        # The predictors are the target's: the quantized model's acceptance is its own (profiled apart).
        if stats is None or routed.retried or routed.backend == "quantized":
            return
        text, turns = prepared.request.text_and_turns()
        evidence = [(self.predictors.alpha, "α", stats.accepted_tokens, stats.judged_tokens)]
        if self.predictors.proposal_rate is not None:
            evidence.append((self.predictors.proposal_rate, "ρ", stats.drafts, stats.requested_steps))
        for predictor, what, hits, trials in evidence:
            if not trials:
                continue
            try:
                predictor.observe(
                    text, turns, prepared.prompt_tokens, stats.drafter, prepared.options.category, hits, trials
                )
            except (ProfileError, KeyError, ValueError) as exc:  # a drafter the profile never measured
                log.info("%s feedback skipped: %s", what, exc)

    async def metrics_exposition(self) -> tuple[bytes, str]:
        """The Prometheus text of the router's metrics and every backend's step loop it can reach."""
        snapshots = await self.pool.loop_snapshots() if isinstance(self.pool, ObservedPool) else []
        return self.metrics.render(snapshots)

    def below_quality_floor(self) -> list[str]:
        """Backends the policy may not pick for quality (the int8 backend under its agreement floor)."""
        quantized = self.profile.quantized
        served = quantized is not None and self.policy.quantization.meets_floor(quantized.agreement)
        return [] if served else ["quantized"]

    def provisional_note(self) -> str | None:
        """What /healthz and /v1/models say while the profile is provisional (None: a full one)."""
        if not self.profile.provisional:
            return None
        return (
            f"provisional profile: {self.profile.coverage()}; the policy decides with what is measured so far "
            "(each decision says so) and each backend's step loop times its own passes and chooses k from them; "
            "`specroute serve` measures the full profile between requests and switches to it when done"
        )

    async def health(self) -> dict[str, Any]:
        """What /healthz says: `status` is "ok" only while every backend has a live replica and the
        last policy applied; `problems` says what is wrong otherwise."""
        m = self.profile.model
        backends = await self.pool.health() if isinstance(self.pool, ObservedPool) else {}
        problems = [f"{b}: {why}" for b, why in backends.items() if why]
        if self.policy_error:
            problems.append(f"the last policy was refused (the previous one still rules): {self.policy_error}")
        if self.profile_error:
            problems.append(f"the last profile was refused (the previous one still rules): {self.profile_error}")
        return {
            "status": "degraded" if problems else "ok",
            "problems": problems,
            "backends": {b: backends.get(b) or "live" for b in BACKENDS} if backends else None,
            "in_flight": {b: self.load[b] for b in BACKENDS},
            # known once a backend was sent a request; the policy divides each backend's load by them
            "replicas": self.pool.replica_counts() if isinstance(self.pool, ReplicatedPool) else None,
            "below_quality_floor": self.below_quality_floor(),
            # per backend and load (concurrency, powers of two): measured time per token over the profile's
            "calibration": self.calibration.summary(),
            "policy": self.policy.model_dump(mode="json"),
            "policy_error": self.policy_error,
            "served_drafters": self.drafters,
            "profile": f"{m.name} {m.served}, measured {self.profile.created:%Y-%m-%d %H:%M} UTC",
            "engine": m.engine,
            "profile_provisional": self.provisional_note(),
            "dtype": self.dtype_choice.dtype,
            "dtype_reason": self.dtype_choice.reason,
        }
