"""What each backend is predicted to do for one request at a given concurrency, from the measured
profile and the cost model: the numbers behind every decision and every `advise` table row."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from .cost_model import (
    best_speculative_k,
    break_even_concurrency,
    effective_verify_costs,
    elasticity,
    per_token_seconds,
    speedup,
    tokens_per_step,
)
from .profile import CostCurve, DrafterProfile, Profile, ProfileError

Backend = Literal["speculative", "plain", "quantized"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)


class Candidate(BaseModel):
    """One way to serve the request, with its predicted numbers."""

    backend: Backend
    drafter: str | None = None
    alpha: float | None = Field(None, description="predicted per-token acceptance")
    alpha_source: str | None = None
    proposal_rate: float = Field(1.0, description="share of steps the drafter proposes in (prompt lookup: a match)")
    k: int = Field(0, description="drafted tokens per step (0: no speculation)")
    expected_tokens: float = Field(1.0, description="tokens per step: 1 + ρ·(E(α, k) − 1)")
    c: float = Field(0.0, description="one draft step over one target step at this concurrency")
    v: float = Field(1.0, description="v(b, k): the verify pass over a 1-token pass")
    speedup: float = Field(description="tokens/s over plain decoding at the same concurrency")
    tpot_ms: float = Field(description="predicted time per output token")
    ttft_ms: float = Field(description="predicted time to first token (prefill)")
    latency_ms: float = Field(description="predicted end-to-end latency for max_tokens tokens")
    tokens_per_s: float = Field(description="predicted output tokens/s over all sequences at this concurrency")
    meets_slo: bool = True


class ProfileCosts:
    """The profile's curves read the way the cost model wants them, for sequences holding
    `context` cached tokens on average while they decode (None: the context the target curve was
    measured at). Context matters: attention reads every cached token, so longer contexts make
    every pass dearer and a wide pass relatively cheaper (v(b, k) falls)."""

    def __init__(self, profile: Profile, context: float | None = None):
        self.profile = profile
        self.target = profile.target
        self.context = context

    def pass_s(self, batch: float, width: int) -> float:
        return self.profile.pass_seconds(batch, width, self.context)

    def step_s(self, batch: float) -> float:
        return self.pass_s(batch, 1)

    def verify_costs(self, batch: float) -> list[float]:
        """v(b, k) for k = 0..max_width-1 with the engine's cheapest-width padding."""
        return effective_verify_costs([self.pass_s(batch, w) for w in self.target.widths])

    def draft_cost(self, drafter: DrafterProfile, batch: float) -> float:
        return drafter.step_at(batch) / self.step_s(batch)

    def elasticity(self, batch: float) -> float:
        batches = self.target.batches
        return elasticity(batches, [self.step_s(b) for b in batches], batch)

    def ttft_s(self, prompt_tokens: int) -> float:
        return self.profile.prefill.per_token(1, prompt_tokens)


def decode_context(prompt_tokens: float, max_tokens: float) -> float:
    """The mean context a sequence holds while it decodes: its prompt and half its answer."""
    return prompt_tokens + max_tokens / 2


def plain_candidate(costs: ProfileCosts, batch: int, prompt_tokens: int, max_tokens: int) -> Candidate:
    step = costs.step_s(batch)
    return _candidate("plain", costs.ttft_s(prompt_tokens), step, batch, max_tokens, speedup=1.0)


def speculative_candidate(
    costs: ProfileCosts,
    drafter: DrafterProfile,
    alpha: float,
    alpha_source: str,
    proposal_rate: float,
    batch: int,
    prompt_tokens: int,
    max_tokens: int,
    k_range: tuple[int, int],
) -> Candidate:
    """The best k in k_range at this concurrency and what it buys over plain decoding."""
    k, c, v, v_plain, gain = speculation_at(costs, drafter, alpha, proposal_rate, batch, k_range)
    token_s = per_token_seconds(costs.step_s(batch), alpha, k, c, v, proposal_rate, batch, v_plain)
    return _candidate("speculative", costs.ttft_s(prompt_tokens), token_s, batch, max_tokens, speedup=gain).model_copy(
        update={
            "drafter": drafter.name,
            "alpha": alpha,
            "alpha_source": alpha_source,
            "proposal_rate": proposal_rate,
            "k": k,
            "expected_tokens": tokens_per_step(alpha, k, proposal_rate),
            "c": c,
            "v": v,
        }
    )


def speculation_at(
    costs: ProfileCosts,
    drafter: DrafterProfile,
    alpha: float,
    proposal_rate: float,
    batch: int,
    k_range: tuple[int, int],
) -> tuple[int, float, float, float, float]:
    """(k, c, v, v without a proposal, speedup) of this drafter's best speculation at this
    concurrency. A structured drafter (lookahead) has no k to choose: each of its steps runs its
    block_width-wide pass, proposal or not, and verifies up to block_draft tokens (within k_max)."""
    c = costs.draft_cost(drafter, batch)
    if drafter.block_width is None or drafter.block_draft is None:
        verify = costs.verify_costs(batch)
        k, gain = best_speculative_k(alpha, c, verify, k_range[0], k_range[1], proposal_rate, batch)
        return k, c, verify[k], verify[0], gain
    if drafter.block_width > costs.target.max_width:
        raise ProfileError(
            f"{drafter.name} runs passes of {drafter.block_width} positions; the profile measured up to "
            f"{costs.target.max_width} (profile again with it among --drafters)"
        )
    v = costs.pass_s(batch, drafter.block_width) / costs.step_s(batch)
    k = min(drafter.block_draft, k_range[1])
    return k, c, v, v, speedup(alpha, k, c, v, proposal_rate, batch, v)


class QuantizedCosts(ProfileCosts):
    """The quantized backend's passes read as ProfileCosts reads the target's: its measured curve,
    plus the seconds the target's context adds to a pass (attention over the cache runs in float
    either way, so context adds the same seconds to both)."""

    def __init__(self, costs: ProfileCosts, batch: int):
        assert costs.profile.quantized is not None
        super().__init__(costs.profile, costs.context)
        self.base, self.batch = costs, batch
        self.target = costs.profile.quantized.curve

    def pass_s(self, batch: float, width: int) -> float:
        base = self.base.target
        return self.target.at(batch, width) + self.base.pass_s(batch, width) - base.at(batch, width)

    def ttft_s(self, prompt_tokens: int) -> float:
        return self.base.ttft_s(prompt_tokens) * prefill_scale(self.target, self.base.target, self.batch)


def prefill_scale(curve: CostCurve, target: CostCurve, batch: float) -> float:
    """Prefill on weights whose 1-token passes `curve` measured, over the target's, at `batch`
    requests in flight: it scales like the decode step at that concurrency (the same weights are
    read, the same share is saved). The policy and the capacity simulator both read it here."""
    return curve.at(batch, 1) / target.at(batch, 1)


def measured_ks(k_range: tuple[int, int], costs: ProfileCosts) -> tuple[int, int]:
    """k_range within the verify widths `costs` measured (a (k+1)-token pass needs its time)."""
    widest = costs.target.max_width - 1
    k_max = min(k_range[1], widest)
    return min(k_range[0], k_max), k_max


def quantized_candidates(
    costs: ProfileCosts,
    batch: int,
    prompt_tokens: int,
    max_tokens: int,
    alphas: dict[str, tuple[float, str, float]] | None = None,
    k_range: tuple[int, int] = (1, 8),
) -> list[Candidate]:
    """The quantized backend decoding plain, and speculating with each of its drafters that has an
    α for this request (`alphas`: drafter name → (α, where it came from, ρ), measured on the
    quantized model's own tokens) where its curve has the verify widths. Speedups are over the
    plain target at this concurrency, so they compare with every other candidate's."""
    if costs.profile.quantized is None:
        return []
    q = QuantizedCosts(costs, batch)
    step, base = q.step_s(batch), costs.step_s(batch)
    plain = _candidate("quantized", q.ttft_s(prompt_tokens), step, batch, max_tokens, speedup=base / step)
    out = [plain]
    if q.target.max_width < 2:
        return out
    ks = measured_ks(k_range, q)
    for name, (alpha, source, rho) in (alphas or {}).items():
        drafter = costs.profile.drafter(name)
        spec = speculative_candidate(q, drafter, alpha, source, rho, batch, prompt_tokens, max_tokens, ks)
        gain = spec.speedup * base / step
        out.append(spec.model_copy(update={"backend": "quantized", "speedup": gain}))
    return out


def _candidate(
    backend: Backend, ttft_s: float, token_s: float, batch: int, max_tokens: int, speedup: float
) -> Candidate:
    return Candidate(
        backend=backend,
        speedup=speedup,
        tpot_ms=token_s * 1e3,
        ttft_ms=ttft_s * 1e3,
        latency_ms=(ttft_s + max(max_tokens - 1, 0) * token_s) * 1e3,
        tokens_per_s=batch / token_s,
    )


def speculation_break_even(
    costs: ProfileCosts, drafter: DrafterProfile, candidate: Candidate, k_range: tuple[int, int], b_max: int
) -> int | None:
    """The concurrency from which this request's best speculation (same α and ρ) stops beating
    plain decoding; None when it still pays at b_max."""
    assert candidate.alpha is not None

    def best(b: int) -> float:
        return speculation_at(costs, drafter, candidate.alpha, candidate.proposal_rate, b, k_range)[4]

    return break_even_concurrency(best, b_max)
