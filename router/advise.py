"""Advice for one request without running it: features (prompt tokens, predicted α per drafter) →
`policies.decide` → the decision, its reasons and a table of every candidate. The CLI's `advise`
and the service's `/v1/advise` both go through here."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field
from transformers import PreTrainedTokenizerBase

from backends.generation import GenerationRequest
from backends.plain import prompt_ids
from policies.config import PolicyConfig
from policies.policy import AlphaInput, Decision, LoadSnapshot, RequestFeatures, decide
from policies.profile import Profile, ProfileError
from policies.serving_dtype import DtypeChoice
from profiler.predictor import AlphaPredictor


@dataclass
class Predictors:
    """Per-prompt predictions of a drafter's α and of its proposal rate ρ, refitted from the profile."""

    alpha: AlphaPredictor
    proposal_rate: AlphaPredictor | None  # None: the profile's per-category ρ is used

    @classmethod
    def from_profile(cls, profile: Profile) -> Predictors:
        try:
            rho = AlphaPredictor.from_profile(profile, target="proposal_rate")
        except ProfileError:
            rho = None
        return cls(AlphaPredictor.from_profile(profile, target="alpha"), rho)


class BackendSummary(BaseModel):
    """One backend's weights as the profile measured them: what it holds in memory and, for the
    quantized backend, its method and measured quality against the full-precision target."""

    backend: str
    weights: str = Field(description="the target's dtype, or the quantization method")
    weight_bytes: int | None = Field(description="resident weight bytes of the target (drafters separate)")
    drafter_bytes: dict[str, int] = Field(default_factory=dict, description="weights each drafter adds")
    linear_kernels: str | None = Field(
        None, description="the target's linear kernels on a CPU: 'packed' keeps a second, reordered copy of its weights"
    )
    agreement: float | None = Field(None, description="teacher-forced top-1 agreement with the full-precision target")
    perplexity_delta: float | None = None
    greedy_match: float | None = Field(None, description="share of held-out prompts with identical greedy tokens")
    max_weight_error: float | None = None
    drafters: dict[str, float | None] = Field(
        default_factory=dict,
        description="the drafters it speculates with and their mean α measured on its own tokens (the speculative "
        "backend's α is per category in the profile: None here); the quantized backend's stack speculation on it",
    )


def backend_summaries(profile: Profile) -> list[BackendSummary]:
    m, q = profile.model, profile.quantized
    drafters = {d.name: d.weight_bytes for d in profile.drafters if d.weight_bytes}
    # llama.cpp's weights are measured against the float target as a quantized backend's are
    quality = {} if m.quality is None else m.quality.model_dump(exclude={"method"})
    target = {"weights": m.served, "weight_bytes": m.weight_bytes, "linear_kernels": m.linear_kernels, **quality}
    rows = [
        BackendSummary(
            backend="speculative",
            drafter_bytes=drafters,
            drafters=dict.fromkeys(d.name for d in profile.drafters),
            **target,
        ),
        BackendSummary(backend="plain", **target),
    ]
    if q is not None:
        rows.append(
            BackendSummary(
                backend="quantized",
                weights=q.method,
                weight_bytes=q.weight_bytes,
                agreement=q.agreement,
                perplexity_delta=q.perplexity_delta,
                greedy_match=q.greedy_match,
                max_weight_error=q.max_weight_error,
                drafters={name: q.mean_alpha(name) for name in dict.fromkeys(a.drafter for a in q.acceptance)},
            )
        )
    return rows


def render_backends(rows: list[BackendSummary]) -> list[str]:
    lines = ["backends (weights resident; quality against the full-precision target, measured by the profile):"]
    for r in rows:
        size = "—" if r.weight_bytes is None else f"{r.weight_bytes / 2**20:.0f} MiB"
        extra = "".join(f", + {name} {b / 2**20:.0f} MiB" for name, b in r.drafter_bytes.items())
        if r.linear_kernels == "packed" and r.weight_bytes is not None:
            extra += f", + packed copy {r.weight_bytes / 2**20:.0f} MiB"
        quality = ""
        if r.agreement is not None:
            quality = f"; agreement {r.agreement:.1%}"
            if r.perplexity_delta is not None:
                quality += f", perplexity {r.perplexity_delta:+.2%}"
            if r.greedy_match is not None:
                quality += f", identical greedy answers {r.greedy_match:.0%}"
        stacked = [f"{name} (α {alpha:.2f} on it)" for name, alpha in r.drafters.items() if alpha is not None]
        if r.backend == "quantized" and stacked:
            quality += f"; speculates with {', '.join(stacked)}"
        lines.append(f"  {r.backend:12} {r.weights:18} {size}{extra}{quality}")
    return lines


class Advice(BaseModel):
    """What `advise --json` prints: the decision at the top level, plus what it was computed from."""

    backend: str
    drafter: str | None
    k: int | None
    stage: str
    reasons: list[str]
    candidates: list[dict[str, object]]
    break_even: dict[str, int | None]
    max_batch: int = Field(description="the policy's batching.max_batch: how far break-even was searched")
    concurrency: int
    bottleneck: str
    elasticity: float
    features: RequestFeatures
    profile: str = Field(description="when and on what the profile was measured")
    backends: list[BackendSummary] = Field(default_factory=list, description="each backend's weights and quality")
    dtype: DtypeChoice | None = Field(None, description="the dtype the target serves in, and why")


def request_features(
    request: GenerationRequest | None,
    category: str | None,
    profile: Profile,
    predictors: Predictors | None,
    tokenizer: PreTrainedTokenizerBase | None,
    max_tokens: int,
    ids: list[int] | None = None,
) -> RequestFeatures:
    """α per drafter from the predictor when there is a prompt; with only a category, the profile's
    measured mean for it (`decide` falls back to that) and the category's mean prompt length.
    `ids`: the prompt's token ids where the caller has them (else the prompt is tokenized here)."""
    if category is not None and category not in profile.categories:
        raise ProfileError(f"category {category!r} was not profiled (profiled: {', '.join(profile.categories)})")
    if request is None:
        if category is None:
            raise ProfileError("give a prompt, a category, or both")
        return RequestFeatures(
            prompt_tokens=profile.mean_prompt_tokens(category) or 1, max_tokens=max_tokens, category=category
        )
    if tokenizer is None:
        raise ValueError("a tokenizer is needed to count the prompt's tokens")
    tokens = len(ids if ids is not None else prompt_ids(tokenizer, request))
    text, turns = request.text_and_turns()
    alphas = {}
    if predictors is not None:
        for name in predictors.alpha.drafters:
            alpha = predictors.alpha.predict(text, turns, tokens, name, category)
            rho = None
            if predictors.proposal_rate is not None:
                rho = predictors.proposal_rate.predict(text, turns, tokens, name, category).alpha
            alphas[name] = AlphaInput(alpha=alpha.alpha, source=alpha.source, proposal_rate=rho)
    return RequestFeatures(prompt_tokens=tokens, max_tokens=max_tokens, category=category, alphas=alphas)


def advise(
    features: RequestFeatures,
    concurrency: int,
    profile: Profile,
    config: PolicyConfig,
    dtype: DtypeChoice | None = None,
) -> Advice:
    # Everything else in flight counts toward the load: every backend shares this machine.
    load = LoadSnapshot(in_flight={"other": concurrency - 1})
    return to_advice(decide(features, load, profile, config), features, profile, config, dtype)


def to_advice(
    decision: Decision,
    features: RequestFeatures,
    profile: Profile,
    config: PolicyConfig,
    dtype: DtypeChoice | None = None,
) -> Advice:
    m = profile.model
    return Advice(
        backend=decision.backend,
        drafter=decision.drafter,
        k=decision.k,
        stage=decision.stage,
        reasons=decision.reasons,
        candidates=[c.model_dump() for c in decision.candidates],
        break_even=decision.break_even,
        max_batch=config.batching.max_batch,
        concurrency=decision.concurrency,
        bottleneck=decision.bottleneck,
        elasticity=decision.elasticity,
        features=features,
        profile=f"{m.name} {m.dtype} on {profile.machine.get('cpu')}, measured {profile.created:%Y-%m-%d %H:%M} UTC",
        backends=backend_summaries(profile),
        dtype=dtype,
    )


def render_advice(advice: Advice) -> str:
    f = advice.features
    chosen = advice.backend + (f" ({advice.drafter}, k={advice.k})" if advice.drafter else "")
    lines = [
        f"decision: {chosen} — decided at the {advice.stage} stage, concurrency {advice.concurrency}",
        f"request: {f.prompt_tokens} prompt tokens, up to {f.max_tokens} new"
        + (f", category {f.category}" if f.category else ""),
        "",
        "why:",
        *[f"  {i}. {reason}" for i, reason in enumerate(advice.reasons, 1)],
        "",
        "candidates (predicted at this concurrency; speedup over plain decoding):",
        f"  {'backend':12} {'drafter':36} {'α̂':>5} {'ρ':>4} {'k':>2} {'E':>5} {'c':>6} {'v(b,k)':>6} "
        f"{'speedup':>7} {'TPOT ms':>8} {'latency ms':>10} {'tok/s':>7}  SLO",
    ]
    for c in advice.candidates:
        alpha = "—" if c["alpha"] is None else f"{c['alpha']:.2f}"
        lines.append(
            f"  {c['backend']:12} {c['drafter'] or '—':36} {alpha:>5} {c['proposal_rate']:4.2f} {c['k']:>2} "
            f"{c['expected_tokens']:5.2f} "
            f"{c['c']:6.3f} {c['v']:6.2f} {c['speedup']:6.2f}× {c['tpot_ms']:8.1f} {c['latency_ms']:10.0f} "
            f"{c['tokens_per_s']:7.1f}  {'met' if c['meets_slo'] else 'missed'}"
        )
    top = max(advice.concurrency, advice.max_batch)
    for drafter, b in advice.break_even.items():
        where = f"from concurrency {b}" if b is not None else f"at any concurrency up to {top}"
        lines.append(f"  speculation with {drafter} on this request stops beating plain decoding {where}")
    lines += ["", *render_backends(advice.backends), "", f"profile: {advice.profile}"]
    if advice.dtype is not None:
        lines += ["", *render_dtype(advice.dtype)]
    return "\n".join(lines)


def render_dtype(choice: DtypeChoice) -> list[str]:
    """Which dtype serves, why, and each profiled dtype's predicted speeds."""
    how = "picked from this machine's profiles" if choice.source == "measured" else "as configured"
    lines = [f"dtype: {choice.dtype} ({how})", f"  why: {choice.reason}"]
    if choice.outlooks:
        lines.append(
            f"  {'dtype':9} {'exact':5} {'tile':>4} {'step ms':>8} {'plain tok/s':>11} {'best tok/s':>10}  large batch"
        )
    for o in choice.outlooks:
        lines.append(
            f"  {o.dtype:9} {'yes' if o.exact else 'no':5} {o.tile_width or '—':>4} {o.step_ms:8.1f} "
            f"{o.plain_tokens_per_s:11.1f} {o.best_tokens_per_s:10.1f}  "
            f"{o.batch_tokens_per_s:.0f} tok/s at batch {o.batch}"
        )
    return lines
