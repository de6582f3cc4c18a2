"""Synthetic profiles with known closed forms: a pass of w tokens per sequence at batch b takes
fixed + per_token·b·w seconds (weights streamed once per pass + per-token compute), so v(b, k),
the elasticity and the break-even concurrency can all be computed by hand."""

from __future__ import annotations

from datetime import UTC, datetime

from policies.profile import (
    AcceptanceProfile,
    AcceptanceSample,
    ContextCurve,
    CostCurve,
    DrafterProfile,
    ModelSummary,
    Profile,
    QuantizedProfile,
    ShippedQuality,
)

FIXED = 0.070
PER_TOKEN = 0.0025
BATCHES = [1, 2, 4, 8, 16, 32, 64]
WIDTHS = list(range(1, 10))
ALPHAS = {"copy": 0.8, "prose": 0.1, "sparse": 0.9}
PROPOSAL_RATES = {"copy": 1.0, "prose": 1.0, "sparse": 0.2}  # 'sparse': prompt lookup rarely finds a match


def step(batch: float, width: int, fixed: float = FIXED, per_token: float = PER_TOKEN) -> float:
    return fixed + per_token * batch * width


def curve(fixed: float = FIXED, per_token: float = PER_TOKEN) -> CostCurve:
    return CostCurve(
        batches=BATCHES, widths=WIDTHS, seconds=[[step(b, w, fixed, per_token) for w in WIDTHS] for b in BATCHES]
    )


def acceptance(category: str, drafter: str, alpha: float, proposal_rate: float = 1.0) -> AcceptanceProfile:
    survival = [proposal_rate * alpha ** (j + 1) for j in range(8)]
    return AcceptanceProfile(
        category=category,
        drafter=drafter,
        k=8,
        prompts=4,
        steps=100,
        drafts=round(100 * proposal_rate),
        draft_tokens=800,
        accepted_tokens=int(800 * alpha),
        judged_tokens=800,
        alpha=alpha,
        acceptance_rate=alpha,
        proposal_rate=proposal_rate,
        accepted_per_position=survival,
        mean_accepted_length=1 + sum(survival) / max(proposal_rate, 1e-9),
        tokens_per_step=1 + sum(survival),
        gamma=0.0,
    )


def sample(
    prompt_id: str, category: str, drafter: str, text: str, alpha: float, proposal_rate: float = 1.0
) -> AcceptanceSample:
    return AcceptanceSample(
        prompt_id=prompt_id,
        category=category,
        drafter=drafter,
        text=text,
        turns=1,
        prompt_tokens=40,
        judged_tokens=100,
        accepted_tokens=int(100 * alpha),
        alpha=alpha,
        requested_steps=50,
        drafts=round(50 * proposal_rate),
        proposal_rate=round(50 * proposal_rate) / 50,
    )


def synthetic_profile(
    quantized_agreement: float | None = None,
    quantized_speed: float = 0.6,
    model_alpha: float = 0.9,
    quantized_method: str = "int4-weight-only",
    quantized_alphas: dict[str, float] | None = None,
) -> Profile:
    """ngram: nearly free, α 0.8 on 'copy' and 0.1 on 'prose'; model: a draft step costing 40 % of a
    target step at batch 1, α `model_alpha`. Optionally an int8 backend `quantized_speed` × the
    target's step time with the given token agreement (and prompt lookup's α on it per category:
    `quantized_alphas`)."""
    drafters = [
        DrafterProfile(name="ngram", kind="ngram", batches=[1], step_seconds=[1e-4]),
        DrafterProfile(
            name="model:draft@bfloat16",
            kind="model",
            batches=BATCHES,
            step_seconds=[step(b, 1, 0.4 * FIXED, 0.4 * PER_TOKEN) for b in BATCHES],
        ),
    ]
    accept = [acceptance(c, "ngram", a, PROPOSAL_RATES[c]) for c, a in ALPHAS.items()]
    accept += [acceptance(c, "model:draft@bfloat16", model_alpha) for c in ALPHAS]
    samples = [
        sample(
            f"{c}-{i}",
            c,
            d.name,
            f"{c} prompt {i}",
            a if d.kind == "ngram" else model_alpha,
            PROPOSAL_RATES[c] if d.kind == "ngram" else 1.0,
        )
        for c, a in ALPHAS.items()
        for d in drafters
        for i in range(6)
    ]
    quantized = None
    if quantized_agreement is not None:
        quantized = QuantizedProfile(
            method=quantized_method,
            curve=curve(FIXED * quantized_speed, PER_TOKEN * quantized_speed),
            agreement=quantized_agreement,
            # prompt lookup measured on the quantized model's own tokens (`quantized_alphas` per category)
            acceptance=[acceptance(c, "ngram", a, PROPOSAL_RATES[c]) for c, a in (quantized_alphas or {}).items()],
        )
    return Profile(
        created=datetime(2026, 11, 30, tzinfo=UTC),
        machine={"cpu": "test CPU", "logical_cores": 2},
        model=ModelSummary(
            name="SmolLM2-135M-Instruct", dtype="float32", device="cpu", parameters=1, weight_bytes=4, threads=2
        ),
        libraries={"numpy": "test"},
        target=curve(),
        prefill=CostCurve(batches=[1], widths=[16, 256], seconds=[[0.1, 0.5]]),
        drafters=drafters,
        acceptance=accept,
        samples=samples,
        quantized=quantized,
    )


def in_dtype(profile: Profile, dtype: str, speed: float, tile_width: int | None = 9) -> Profile:
    """`profile` as if measured in another dtype: every target pass `speed` × as long, and a lone
    sequence's passes flat in the width up to `tile_width` (width-invariant, as the loop tiles them)."""
    seconds = [[step(b, tile_width if tile_width and b == 1 else w) * speed for w in WIDTHS] for b in BATCHES]
    update = {"dtype": dtype, "tile_width": tile_width, "tile_max_rows": 1 if tile_width else None}
    target = CostCurve(batches=BATCHES, widths=WIDTHS, seconds=seconds)
    return profile.model_copy(update={"model": profile.model.model_copy(update=update), "target": target})


def on_llamacpp(profile: Profile, speed: float, agreement: float | None, prefill_speed: float = 1.0) -> Profile:
    """`profile` as if measured on the llama.cpp engine serving the file: every target pass `speed` ×
    as long, prefill `prefill_speed` × as long, its weights' teacher-forced agreement with the float
    target `agreement`."""
    seconds = [[s * speed for s in row] for row in profile.target.seconds]
    target = profile.target.model_copy(update={"seconds": seconds})
    prefill = profile.prefill.model_copy(update={"seconds": [[s * prefill_speed for s in profile.prefill.seconds[0]]]})
    quality = None if agreement is None else ShippedQuality(method="llamacpp-file", agreement=agreement)
    update = {"engine": "llamacpp", "gguf_weights": "file", "quality": quality, "tile_width": None}
    model = profile.model.model_copy(update=update)
    return profile.model_copy(update={"model": model, "target": target, "prefill": prefill})


REFERENCE = 192
PER_CONTEXT = 0.00002  # seconds per cached token per sequence a pass reads (attention), width-independent


def context_curve(batches: list[int] = BATCHES, contexts: list[int] = [64, 192, 512, 2048]) -> ContextCurve:  # noqa: B006
    """Passes measured as `step` plus PER_CONTEXT·b·(n − REFERENCE): reading the cache costs the
    same whatever the width, so a longer context makes wide passes relatively cheaper."""
    widths = [1, 5, 9]
    return ContextCurve(
        reference=REFERENCE,
        batches=batches,
        contexts=contexts,
        widths=widths,
        seconds=[[[with_context(b, w, n) for w in widths] for n in contexts] for b in batches],
    )


def with_context(batch: float, width: int, context: float) -> float:
    return step(batch, width) + PER_CONTEXT * batch * (context - REFERENCE)
