"""Which dtype the service's target runs in, decided from this machine's profiles.

float32 is the reference: speculative output equals plain output at any pass width. A reduced
precision (bfloat16) moves half the bytes, and is exact at batch 1 only when its passes are
width-invariant (`ModelSummary.tile_width`). Among the exact dtypes profiled, the service serves the
one whose best way to serve a lone request — plain decoding or the speculation the policy would
pick, per profiled category — is predicted faster, geometric mean over the categories. The
quantized backend is left out of the comparison: it runs the same float32 kernels whichever dtype
the others run in. The choice, the figures behind it and the reason are what `/v1/models`,
`/healthz` and `advise` show.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

from .config import PolicyConfig
from .engines import EngineName
from .estimates import ProfileCosts
from .policy import LoadSnapshot, RequestFeatures, decide
from .profile import Profile, ProfileError

DEFAULT_DTYPE = "float32"  # the reference every other dtype is compared with, and the fallback
LOADED_OUTPUT_TOKENS = 64  # output tokens a request of the loaded figure asks for (bench load's default)
SERVED_DTYPES: tuple[str, ...] = ("float32", "bfloat16")  # what `dtype: auto` picks among
# A dtype must beat the one served before it by this much: two profiles measured minutes apart on
# a noisy machine differ by a few percent with nothing changed.
MIN_GAIN = 1.05


class DtypeOutlook(BaseModel):
    """One dtype's profile read for the choice: predicted speeds from measured costs and acceptance."""

    dtype: str = Field(description="the dtype this profile was measured in")
    engine: EngineName = Field("torch", description="the engine its passes ran on")
    served: str = Field("", description="what the target computes in: the dtype, or llama.cpp's weights")
    agreement: float | None = Field(
        None, description="llama.cpp: its weights' teacher-forced agreement with the float target (None: torch)"
    )
    exact: bool = Field(description="speculative greedy output equals plain output at batch 1 in this dtype")
    tile_width: int | None = Field(None, description="width-invariant passes' width (None: natural widths)")
    tile_max_rows: int | None = Field(None, description="with tile_width: the most sequences a tiled pass has")
    step_ms: float = Field(description="one plain decode step at batch 1 (measured)")
    plain_tokens_per_s: float = Field(description="plain decoding of one request")
    best_tokens_per_s: float = Field(
        description="one request served the way the policy would (plain or speculative), geometric mean over the "
        "profiled categories"
    )
    best_by_category: dict[str, str] = Field(
        default_factory=dict, description="what serves each category, and how fast"
    )
    batch: int = Field(description="the largest profiled batch within batching.max_batch")
    batch_tokens_per_s: float = Field(description="plain decoding at that batch, all sequences together")
    loaded_tokens_per_s: float = Field(
        0.0,
        description="output tokens/s with that batch kept full of requests of the profiled prompts' mean length "
        f"and {LOADED_OUTPUT_TOKENS} output tokens each, prefill included (at the longest prefill measured, per "
        "token): what a service under load delivers, where prefill weighs as much as decoding",
    )
    measured: str = Field(description="when and on what the profile was measured")


class DtypeChoice(BaseModel):
    """Which exact dtype the service serves, and why."""

    dtype: str = Field(description="the dtype chosen (float32 or bfloat16)")
    engine: EngineName = Field("torch", description="the engine chosen (engine auto) or configured")
    source: Literal["measured", "configured"] = Field(
        description="measured: picked from the profiles (dtype auto); configured: set in the settings"
    )
    reason: str = Field(description="why, with the predicted speeds it compared")
    outlooks: list[DtypeOutlook] = Field(default_factory=list, description="each profiled dtype's predicted speeds")


def outlook(profile: Profile, config: PolicyConfig) -> DtypeOutlook:
    """Batch-1 speeds of the plain and speculative backends over this profile (quantization off)."""
    alone = config.model_copy(update={"quantization": config.quantization.model_copy(update={"enabled": False})})
    costs = ProfileCosts(profile)
    plain = 1.0 / costs.step_s(1)
    speeds, by_category = [], {}
    for category in profile.categories or [None]:
        tokens = profile.mean_prompt_tokens(category) or 64  # a typical chat prompt where none was sampled
        features = RequestFeatures(prompt_tokens=tokens, max_tokens=256, category=category)
        chosen = decide(features, LoadSnapshot(), profile, alone).chosen()
        speeds.append(chosen.tokens_per_s)
        how = f"{chosen.drafter} k={chosen.k}" if chosen.drafter else "plain"
        by_category[category or "any"] = f"{how}, {chosen.tokens_per_s:.1f} tok/s"
    batch = max([b for b in profile.target.batches if b <= config.batching.max_batch] or [1])
    m = profile.model
    return DtypeOutlook(
        dtype=m.dtype,
        engine=m.engine,
        served=m.served,
        agreement=m.quality.agreement if m.quality is not None else None,
        exact=m.exact_at_batch_one,
        tile_width=m.tile_width,
        tile_max_rows=m.tile_max_rows,
        step_ms=costs.step_s(1) * 1e3,
        plain_tokens_per_s=plain,
        best_tokens_per_s=math.exp(sum(math.log(s) for s in speeds) / len(speeds)),
        best_by_category=by_category,
        batch=batch,
        batch_tokens_per_s=batch / costs.step_s(batch),
        loaded_tokens_per_s=_loaded(profile, costs, batch),
        measured=f"{profile.machine.get('cpu')}, {profile.created:%Y-%m-%d %H:%M} UTC",
    )


def _loaded(profile: Profile, costs: ProfileCosts, batch: int) -> float:
    """Output tokens/s of `batch` rows kept busy by requests of the profiled mean prompt, prefill
    included: each request's prompt costs its tokens at the measured prefill rate, each output
    token its share of a batch-`batch` decode step."""
    prompt = profile.mean_prompt_tokens() or 64
    length, seconds = profile.prefill.widths[-1], profile.prefill.seconds[0][-1]
    per_request = prompt * seconds / length + LOADED_OUTPUT_TOKENS * costs.step_s(batch) / batch
    return LOADED_OUTPUT_TOKENS / per_request


def choose_dtype(profiles: Sequence[Profile], config: PolicyConfig, missing: str | None = None) -> DtypeChoice:
    """The exact dtype predicted fastest for a lone request; float32 unless another beats it by
    MIN_GAIN. `missing` says why a dtype was not profiled (it goes into the reason)."""
    outlooks = [outlook(p, config) for p in profiles]
    exact = [o for o in outlooks if o.exact]
    if not exact:
        raise ProfileError("no profile of an exact dtype to serve: profile float32 (`specroute profile`)")
    reference = next((o for o in exact if o.dtype == DEFAULT_DTYPE), exact[0])
    best = max(exact, key=lambda o: o.best_tokens_per_s)
    chosen = best if best.best_tokens_per_s >= MIN_GAIN * reference.best_tokens_per_s else reference
    return DtypeChoice(
        dtype=chosen.dtype, source="measured", reason=_reason(chosen, outlooks, missing), outlooks=outlooks
    )


def configured(dtype: str, profiles: Sequence[Profile], config: PolicyConfig, reason: str | None = None) -> DtypeChoice:
    """A dtype the settings name, with what the profiles at hand predict for it and the others."""
    outlooks = [outlook(p, config) for p in profiles]
    why = reason or f"{dtype}: set in the settings (backend.dtype; auto picks from the profiles)"
    return DtypeChoice(dtype=dtype, source="configured", reason=why, outlooks=outlooks)


def choose_engine(
    torch_choice: DtypeChoice, llama: Profile | None, config: PolicyConfig, missing: str | None = None
) -> DtypeChoice:
    """Engine auto: the llama.cpp engine's profile against the torch engine's chosen dtype, read the
    same way: a lone request served as the policy would (geometric mean over the categories), and
    a full batch of the profiled prompts, prefill included. Its weights are a numerical model of
    their own: they compete only if their measured agreement with the float target meets the
    quality floor; then they must beat torch by MIN_GAIN alone and not lose by more than that
    under load (an engine serves every load the service sees: on a CPU where llama.cpp decodes
    fast but prefills slowly, a lone request gains and a loaded service loses)."""
    reference = next(o for o in torch_choice.outlooks if o.dtype == torch_choice.dtype and o.engine == "torch")
    if llama is None:
        reason = f"torch: {torch_choice.reason}; llama.cpp not considered: {missing or 'no profile of it here'}"
        return torch_choice.model_copy(update={"reason": reason})
    other = outlook(llama, config)
    outlooks = [*torch_choice.outlooks, other]
    verdict = _llamacpp_verdict(other, reference, config)
    chosen = other if verdict is None else reference
    figures = f"{other.served}: {_figures(other)}, agreement with the float target {other.agreement or 0:.1%}"
    if verdict is None:
        alone, loaded = _ratios(other, reference)
        reason = (
            f"llamacpp: {figures} — {alone:.2f}× torch {reference.dtype} alone and {loaded:.2f}× under load "
            f"({_figures(reference)}), above the quality floor ({config.quantization.min_agreement:.0%}); exact to "
            "its own weights: speculation returns their plain decoding's tokens, which are llama.cpp's, not the "
            "float target's"
        )
    else:
        reason = f"torch: {torch_choice.reason}; {figures} not chosen: {verdict}"
    return DtypeChoice(dtype=chosen.dtype, engine=chosen.engine, source="measured", reason=reason, outlooks=outlooks)


def _llamacpp_verdict(llama: DtypeOutlook, torch: DtypeOutlook, config: PolicyConfig) -> str | None:
    """Why the llama.cpp profile is not served (None: it is)."""
    if llama.agreement is None:
        return "its quality against the float target was not measured (profile it again)"
    if not config.quantization.meets_floor(llama.agreement):
        return f"under the quality floor ({config.quantization.min_agreement:.0%})"
    alone, loaded = _ratios(llama, torch)
    if alone < MIN_GAIN:
        return f"{alone:.2f}× torch {torch.dtype} served alone, short of the {MIN_GAIN:.2f}× a switch needs"
    if loaded < 1 / MIN_GAIN:
        return (
            f"{alone:.2f}× torch {torch.dtype} served alone but {loaded:.2f}× under load (batch {llama.batch}, "
            "prefill included): it would lose where the service is busiest"
        )
    return None


def _ratios(llama: DtypeOutlook, torch: DtypeOutlook) -> tuple[float, float]:
    """llama.cpp over torch: a lone request, and a loaded service."""
    return llama.best_tokens_per_s / torch.best_tokens_per_s, llama.loaded_tokens_per_s / torch.loaded_tokens_per_s


def _reason(chosen: DtypeOutlook, outlooks: list[DtypeOutlook], missing: str | None) -> str:
    parts = [f"{chosen.dtype}: {_figures(chosen)}"]
    for other in outlooks:
        if other is chosen:
            continue
        if not other.exact:
            parts.append(
                f"{other.dtype} not considered: its passes run at natural widths, so speculation would change "
                "its tokens"
            )
        else:
            ratio = chosen.best_tokens_per_s / other.best_tokens_per_s
            verdict = f"{ratio:.2f}× slower served alone"
            if ratio < 1:
                verdict = f"{1 / ratio:.2f}× faster served alone, short of the {MIN_GAIN:.2f}× a switch needs"
            parts.append(f"{other.dtype}: {_figures(other)} ({verdict})")
    if chosen.tile_width is not None:
        rows = {None: "every pass", 1: "every pass of a lone sequence"}.get(
            chosen.tile_max_rows, f"every pass of up to {chosen.tile_max_rows} sequences"
        )
        parts.append(
            f"exact at batch 1: {rows} runs {chosen.tile_width} positions wide, so a request alone gets plain "
            "decoding's tokens from speculation too (rows batched together may differ from alone)"
        )
    if missing:
        parts.append(missing)
    return "; ".join(parts)


def _figures(o: DtypeOutlook) -> str:
    return (
        f"{o.best_tokens_per_s:.1f} tok/s for a lone request (plain {o.plain_tokens_per_s:.1f}, "
        f"step {o.step_ms:.1f} ms), {o.batch_tokens_per_s:.0f} tok/s plain at batch {o.batch}, "
        f"{o.loaded_tokens_per_s:.0f} tok/s there with prefill"
    )
