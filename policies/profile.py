"""The profile: what `specroute profile` measured on one machine for one target model, and the
only source of numbers the policy decides with. Pure pydantic (no torch), so the policy, the
router and tests can read a profile without loading a model.

Versioned: a profile written by another schema version is refused with a message saying how to
measure a new one, never half-read.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .drafters import DrafterKind
from .engines import EngineName, GgufWeights
from .errors import UserError
from .quantization import REDUCED_PRECISION, WEIGHT_ONLY

PROFILE_VERSION = 1


class ProfileError(UserError):
    """A profile that cannot be used: missing, unreadable, another version, or lacking a measurement."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CostCurve(_Frozen):
    """Seconds of one forward pass with `width` new tokens per sequence at batch `batch`.

    Width 1 is a decode step, width k + 1 a verification pass (for the prefill curve, the width is
    the prompt length). Batches between measured ones are interpolated log-log; past the largest
    measured batch the per-sequence cost of the last one is kept (decode is compute-bound there).
    """

    batches: list[int] = Field(min_length=1)
    widths: list[int] = Field(min_length=1)
    seconds: list[list[float]] = Field(description="seconds[i][j]: batch batches[i], width widths[j]")

    @model_validator(mode="after")
    def _shape(self) -> CostCurve:
        if self.batches != sorted(set(self.batches)) or self.widths != sorted(set(self.widths)):
            raise ValueError("batches and widths must be strictly increasing")
        if len(self.seconds) != len(self.batches) or any(len(row) != len(self.widths) for row in self.seconds):
            raise ValueError("seconds must have one row per batch and one column per width")
        if any(s <= 0 or not math.isfinite(s) for row in self.seconds for s in row):
            raise ValueError("every measured time must be a positive number")
        return self

    @property
    def max_width(self) -> int:
        return self.widths[-1]

    def at(self, batch: float, width: int) -> float:
        """Seconds of a pass of exactly `width` tokens per sequence at (possibly unmeasured) `batch`."""
        if width not in self.widths:
            raise ProfileError(f"width {width} was not measured (measured: {self.widths})")
        column = [row[self.widths.index(width)] for row in self.seconds]
        return _interpolate(self.batches, column, max(float(batch), 1.0))

    def per_token(self, batch: float, tokens: int) -> float:
        """Seconds for `tokens` tokens per sequence, interpolated linearly between measured widths
        (used for prefill, whose widths are prompt lengths)."""
        widths = self.widths
        if tokens <= widths[0]:
            return self.at(batch, widths[0]) * tokens / widths[0]
        if tokens >= widths[-1]:
            return self.at(batch, widths[-1]) * tokens / widths[-1]
        i = bisect.bisect_left(widths, tokens)
        lo, hi = widths[i - 1], widths[i]
        share = (tokens - lo) / (hi - lo)
        return (1 - share) * self.at(batch, lo) + share * self.at(batch, hi)


class ContextCurve(_Frozen):
    """How a pass's time grows with the context each sequence has cached: seconds of a pass of
    `width` tokens per sequence at batch `batch` over `context` cached tokens per sequence, measured
    on a grid (cells a time budget left out are None). Attention reads every cached key and value,
    so a pass over 2,048 cached tokens can cost several times one over 64 at a large batch, and
    the ratio of a wide pass to a narrow one — v(b, k) — changes with it.

    The target curve is measured at `reference` tokens of context; `factor` scales it to another
    context: per measured batch, a line in context through the measured contexts (attention's cost
    is linear in it; fitted robustly, see `_row_seconds`) read at that context over the same line at
    the reference, linear in width between measured widths, and linear in log batch between measured
    batches (the largest measured batch's factor beyond it)."""

    reference: int = Field(ge=1, description="the context the target curve was measured at")
    batches: list[int] = Field(min_length=1)
    contexts: list[int] = Field(min_length=2)
    widths: list[int] = Field(min_length=1)
    seconds: list[list[list[float | None]]] = Field(
        description="seconds[i][j][l]: batch batches[i], context contexts[j], width widths[l] (None: not measured)"
    )

    @model_validator(mode="after")
    def _shape(self) -> ContextCurve:
        for name in ("batches", "contexts", "widths"):
            values = getattr(self, name)
            if values != sorted(set(values)) or values[0] < 1:
                raise ValueError(f"{name} must be positive and strictly increasing")
        if len(self.seconds) != len(self.batches) or any(
            len(row) != len(self.contexts) or any(len(cell) != len(self.widths) for cell in row) for row in self.seconds
        ):
            raise ValueError("seconds must be batches × contexts × widths")
        if any(s is not None and (s <= 0 or not math.isfinite(s)) for r in self.seconds for c in r for s in c):
            raise ValueError("every measured time must be a positive number")
        if not self._usable_rows:
            raise ValueError("no batch has two measured contexts")
        return self

    @cached_property
    def _usable_rows(self) -> list[int]:
        """Batches (indices) with every width measured at two or more contexts."""
        return [
            i
            for i, row in enumerate(self.seconds)
            if all(sum(row[j][w] is not None for j in range(len(self.contexts))) >= 2 for w in range(len(self.widths)))
        ]

    def factor(self, batch: float, width: int, context: float) -> float:
        """t(batch, width, context) over t(batch, width, reference)."""
        rows = self._usable_rows
        batches = [self.batches[i] for i in rows]
        ratios = [self._row_factor(i, width, context) for i in rows]
        b = max(float(batch), 1.0)
        if len(rows) == 1 or b <= batches[0]:
            return ratios[0]
        if b >= batches[-1]:
            return ratios[-1]
        i = bisect.bisect_left(batches, b)
        if batches[i] == b:
            return ratios[i]
        lo, hi = math.log(batches[i - 1]), math.log(batches[i])
        share = (math.log(b) - lo) / (hi - lo)
        return (1 - share) * ratios[i - 1] + share * ratios[i]

    def _row_factor(self, row: int, width: int, context: float) -> float:
        intercept, slope, floor = self._line(row, width)
        at = max(intercept + slope * max(float(context), 0.0), floor)
        return at / max(intercept + slope * self.reference, floor)

    def _line(self, row: int, width: int) -> tuple[float, float, float]:
        """One batch's pass time at `width` as a line in context (intercept, slope, and a floor it is
        never read below): linear in width between measured widths, and a line through that batch's
        measured contexts — attention's cost grows linearly with the context — fitted by Theil–Sen
        (the median of the pairwise slopes), so one pass slowed by a busy machine does not bend the
        whole curve. Fitted once per batch and width: the step loop reads it every step."""
        key = (row, width)
        if key not in self._lines:
            points = [
                (self.contexts[j], _linear(self.widths, [float(s) for s in cell if s is not None], width))
                for j, cell in enumerate(self.seconds[row])
                if all(s is not None for s in cell)
            ]
            slopes = [(t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(points) for n2, t2 in points[i + 1 :]]
            slope = max(statistics.median(slopes), 0.0)
            intercept = statistics.median(t - slope * n for n, t in points)
            self._lines[key] = (intercept, slope, min(t for _, t in points) * 0.25)
        return self._lines[key]

    @cached_property
    def _lines(self) -> dict[tuple[int, int], tuple[float, float, float]]:
        return {}


def _linear(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended along the end segments' slopes (never falling
    past the ends: a longer context or wider pass does not get cheaper there)."""
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
        return ys[0] - slope * (xs[0] - x)
    if x >= xs[-1]:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return ys[-1] + slope * (x - xs[-1])
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    share = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return (1 - share) * ys[i - 1] + share * ys[i]


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]  # beyond the measurements, a sequence costs its current share
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    lo, hi = math.log(xs[i - 1]), math.log(xs[i])
    share = (math.log(x) - lo) / (hi - lo)
    return math.exp((1 - share) * math.log(ys[i - 1]) + share * math.log(ys[i]))


class DrafterProfile(_Frozen):
    """One drafter's cost: seconds per sequential draft step by batch (c = that over a target step)."""

    name: str = Field(description="the engine's drafter name, e.g. 'ngram' or 'model:SmolLM2-135M-Instruct@bfloat16'")
    kind: DrafterKind
    batches: list[int] = Field(min_length=1)
    step_seconds: list[float] = Field(min_length=1, description="one draft step (one token per sequence)")
    probed_seconds: list[float] | None = Field(None, description="a bare forward pass of the draft model, by batch")
    calibration: float = Field(1.0, gt=0, description="step_seconds over probed_seconds: the in-run overhead")
    weight_bytes: int | None = Field(
        None, ge=0, description="memory its weights add to a replica beyond the target's (None: not recorded)"
    )
    block_width: int | None = Field(
        None,
        ge=2,
        description="a structured drafter (lookahead): every step's pass is this many positions wide, whatever "
        "it proposes (None: a chain drafter, k + 1 wide)",
    )
    block_draft: int | None = Field(None, ge=1, description="a structured drafter: the most tokens it verifies a step")

    @model_validator(mode="after")
    def _shape(self) -> DrafterProfile:
        if len(self.batches) != len(self.step_seconds) or self.batches != sorted(set(self.batches)):
            raise ValueError("one step time per strictly increasing batch size")
        if (self.block_width is None) != (self.block_draft is None):
            raise ValueError("a structured drafter records both block_width and block_draft")
        if any(s < 0 or not math.isfinite(s) for s in self.step_seconds):
            raise ValueError("draft step times must be non-negative numbers")
        return self

    def step_at(self, batch: float) -> float:
        if len(self.batches) == 1:
            return self.step_seconds[0]
        floor = 1e-9  # prompt lookup can take ~0 s; log interpolation needs positive values
        return _interpolate(self.batches, [max(s, floor) for s in self.step_seconds], max(float(batch), 1.0))


class AcceptanceProfile(_Frozen):
    """Acceptance of one drafter on one prompt category, measured at a fixed k (greedy decoding).

    The cost model's two numbers: `proposal_rate` ρ, the share of steps in which the drafter had
    anything to propose (prompt lookup needs a match; a draft model always proposes), and `alpha`,
    the per-token acceptance on those steps: accepted tokens over tokens *judged* (accepted + the
    first rejected or missing one). `acceptance_rate` is vLLM's accepted / drafted, alongside.
    """

    category: str
    drafter: str
    k: int = Field(ge=1, description="tokens requested per step while measuring")
    prompts: int = Field(ge=1)
    steps: int = Field(ge=0, description="sequence-steps that asked the drafter for tokens")
    drafts: int = Field(ge=0, description="of those, steps in which the drafter proposed")
    draft_tokens: int = Field(ge=0)
    accepted_tokens: int = Field(ge=0)
    judged_tokens: int = Field(ge=0)
    alpha: float = Field(ge=0, le=1)
    acceptance_rate: float = Field(ge=0, le=1)
    proposal_rate: float = Field(1.0, ge=0, le=1, description="share of steps in which the drafter proposed")
    accepted_per_position: list[float] = Field(
        description="[j]: share of the steps asking for drafts whose token j+1 was accepted"
    )
    mean_accepted_length: float = Field(ge=1, description="tokens emitted per step with a proposal (vLLM's)")
    tokens_per_step: float = Field(ge=1, description="tokens emitted per step asking for drafts, proposal or not")
    gamma: float = Field(ge=0, description="drafting time per step with a proposal over one target step")


SampleSet = Literal["project", "training"]


class AcceptanceSample(_Frozen):
    """One prompt's measured acceptance: a training example for the α predictor."""

    prompt_set: SampleSet = Field(
        "project",
        description="project: a prompt of the profiled set (its categories' α are the profile's); training: one of "
        "the larger training set, measured only to give the predictor more examples",
    )
    prompt_id: str
    category: str
    drafter: str
    text: str = Field(description="the prompt as the router sees it: message contents joined by newlines")
    turns: int = Field(ge=1, description="number of chat messages")
    prompt_tokens: int = Field(ge=1)
    judged_tokens: int = Field(ge=0)
    accepted_tokens: int = Field(ge=0)
    alpha: float = Field(ge=0, le=1, description="accepted / judged on steps with a proposal")
    requested_steps: int = Field(0, ge=0, description="steps that asked the drafter for tokens")
    drafts: int = Field(0, ge=0, description="steps in which the drafter proposed")
    proposal_rate: float = Field(1.0, ge=0, le=1, description="drafts / requested_steps")


class PredictorScore(_Frozen):
    """Cross-validated error of the α predictor for one drafter (prompts held out, k-fold)."""

    drafter: str
    target: Literal["alpha", "proposal_rate"] = Field("alpha", description="what is predicted")
    folds: int
    samples: int
    mae_with_category: float = Field(description="mean absolute error of α when the caller names the category")
    mae_text_only: float = Field(description="mean absolute error of α from the prompt text alone")
    mae_constant: float = Field(description="baseline: predict the training folds' mean α")
    mae_category_mean: float | None = Field(
        None, description="baseline: predict the training folds' mean α of the prompt's category (None: not scored)"
    )
    model: str | None = Field(
        None, description="the regressor cross-validation chose, e.g. 'ridge' (None: not recorded)"
    )


class ReliabilityBin(_Frozen):
    """Drafted positions whose predicted acceptance fell in [low, high): how many, their mean
    prediction and how many were accepted (a calibrated map has mean_predicted ≈ accepted share)."""

    low: float = Field(ge=0, le=1)
    high: float = Field(ge=0, le=1)
    count: int = Field(ge=0)
    mean_predicted: float = Field(ge=0, le=1)
    accepted_share: float = Field(ge=0, le=1)


class AcceptanceMap(_Frozen):
    """A drafter's per-proposal acceptance predictor: P(drafted position accepted | every earlier
    one was) = σ(coef · features + intercept), the features being what the drafter reports with
    each proposal (`backends.speculative.acceptance` names them). Fitted on the judged positions
    of acceptance runs; scored out of fold (prompts held out)."""

    drafter: str
    features: list[str] = Field(min_length=1)
    coef: list[float]
    intercept: float
    samples: int = Field(ge=0, description="judged drafted positions it was fitted on")
    prompts: int = Field(0, ge=0, description="prompts those came from")
    brier: float | None = Field(None, ge=0, description="out-of-fold Brier score of the map")
    brier_constant: float | None = Field(
        None, ge=0, description="out-of-fold Brier score of a constant (the folds' acceptance rate)"
    )
    reliability: list[ReliabilityBin] = Field(default_factory=list, description="out-of-fold reliability curve")

    @model_validator(mode="after")
    def _one_weight_per_feature(self) -> AcceptanceMap:
        if len(self.coef) != len(self.features):
            raise ValueError(f"{len(self.coef)} coefficients for {len(self.features)} features")
        return self


class QuantizedProfile(_Frozen):
    """A quantized backend: its method, cost curve, resident weights and measured quality against
    the full-precision target."""

    method: str
    curve: CostCurve
    agreement: float = Field(
        ge=0, le=1, description="teacher-forced top-1 agreement with the full-precision target on held-out text"
    )
    perplexity_delta: float | None = Field(None, description="relative perplexity change on a text set")
    greedy_match: float | None = Field(
        None, ge=0, le=1, description="share of held-out prompts whose first greedy tokens are all the target's"
    )
    weight_bytes: int | None = Field(None, ge=0, description="the quantized model's weights (None: not recorded)")
    max_weight_error: float | None = Field(
        None, ge=0, description="largest |w − w as the kernel computes it| (weight-only methods)"
    )
    acceptance: list[AcceptanceProfile] = Field(
        default_factory=list,
        description="the quantized backend's drafters (quantized_drafters) measured on its own tokens, per "
        "category: it is a numerical model of its own, so its acceptance is measured, not taken from the target's",
    )
    tile_width: int | None = Field(
        None, ge=2, description="its passes' width where they run tiled to make speculation exact (torch)"
    )

    def acceptance_for(self, category: str, drafter: str) -> AcceptanceProfile | None:
        """The measured acceptance of `drafter` (its profile name) in `category`, if any."""
        return next((a for a in self.acceptance if a.category == category and a.drafter == drafter), None)

    def mean_alpha(self, drafter: str) -> float | None:
        """α of `drafter` over every measured category, weighted by judged tokens."""
        rows = [a for a in self.acceptance if a.drafter == drafter and a.judged_tokens]
        judged = sum(a.judged_tokens for a in rows)
        return sum(a.alpha * a.judged_tokens for a in rows) / judged if judged else None


class ShippedQuality(_Frozen):
    """A quantized model's agreement with the full-precision target: a property of the two models
    (for llama.cpp's weights, of its kernels too: its 8-bit activations round as the CPU's kernels do)."""

    method: str
    agreement: float = Field(ge=0, le=1)
    perplexity_delta: float | None = None
    greedy_match: float | None = Field(None, ge=0, le=1)
    measured_on: str | None = Field(
        None, description="where and when, if not with the seed's acceptance (llama.cpp's weights: their own run)"
    )


class ModelSummary(_Frozen):
    name: str
    dtype: str
    device: str
    parameters: int
    weight_bytes: int
    threads: int
    fingerprint: str | None = Field(None, description="the weights' fingerprint (what shipped acceptance is tied to)")
    kv_bytes_per_token: int | None = Field(
        None, ge=0, description="KV-cache bytes one cached token takes, keys and values over every layer"
    )
    tile_width: int | None = Field(
        None,
        ge=1,
        description="the width every decode and verify pass ran at (width-invariant passes: speculative output "
        "equals plain output at batch 1 in this dtype); None: natural widths",
    )
    tile_max_rows: int | None = Field(
        None, ge=1, description="with tile_width: passes of more sequences than this ran at natural widths"
    )
    linear_kernels: str | None = Field(
        None,
        description="the linear kernels the profile's passes ran on a CPU ('packed' or 'torch'; chosen by measurement)",
    )
    engine: EngineName = Field("torch", description="what ran the target's passes (policies.engines)")
    gguf_weights: GgufWeights | None = Field(
        None, description="the llamacpp engine: the weights it served (the file's own, or the file requantized)"
    )
    quality: ShippedQuality | None = Field(
        None,
        description="the llamacpp engine: its weights' quality against the float target (a numerical model of "
        "their own, admitted by the policy's quality floor as a quantized backend is); None on torch (the reference)",
    )

    @property
    def exact_at_batch_one(self) -> bool:
        """Whether speculative greedy output equals plain output at batch 1 in this dtype: float32's
        kernels give a token the same logits at any pass width here; reduced precision needs tiles;
        the llama.cpp engine refuses to speculate on weights its probe finds width-variant, so a
        profile of it exists only where it is exact (to its own weights)."""
        if self.engine == "llamacpp":
            return True
        return self.dtype not in REDUCED_PRECISION or self.tile_width is not None

    @property
    def served(self) -> str:
        """What the target computes in, as /v1/models and the reasons name it."""
        if self.engine == "llamacpp":
            return f"llama.cpp {self.gguf_weights or 'file'}"
        return self.dtype


class DrafterName(_Frozen):
    name: str = Field(description="the engine's name for it")
    kind: DrafterKind


class AcceptanceSeed(_Frozen):
    """The machine-independent half of a profile, shipped with specroute for the embedded default
    so that a first start measures only this machine's cost curves: greedy acceptance (α and ρ per
    category, drafter and prompt) and the int8 model's agreement. Greedy tokens in float32 depend
    on the model and drafter, not on the machine (another CPU's kernels can flip a near-tie, rarely),
    so these are used only for the model whose fingerprint they carry, in the dtype they were
    measured in, and the service keeps refining α online as it always does. A bfloat16 seed's
    tokens depend more on the machine (its kernels round differently), its α per category little."""

    version: Literal[1] = PROFILE_VERSION
    created: datetime
    model: str = Field(description="the target's name")
    fingerprint: str = Field(description="the target's fingerprint (backends.models.weights_fingerprint)")
    dtype: Literal["float32", "bfloat16"] = "float32"
    machine: dict[str, str | int | float | None] = Field(description="where it was measured")
    libraries: dict[str, str]
    settings: dict[str, object] = Field(description="the acceptance settings it was measured with")
    drafters: list[DrafterName] = Field(min_length=1)
    acceptance: list[AcceptanceProfile] = Field(min_length=1)
    samples: list[AcceptanceSample] = Field(default_factory=list)
    quality: list[ShippedQuality] = Field(default_factory=list, description="one per quantization method measured")

    @field_validator("quality", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [] if value is None else [value] if isinstance(value, dict) else value

    def quality_of(self, method: str) -> ShippedQuality | None:
        return next((q for q in self.quality if q.method == method), None)

    def save(self, path: Path) -> None:
        _write(path, self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: Path) -> AcceptanceSeed:
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValidationError) as exc:
            raise ProfileError(f"cannot use the shipped acceptance {path}: {exc}") from None


class Profile(_Frozen):
    version: Literal[1] = PROFILE_VERSION
    created: datetime
    machine: dict[str, str | int | float | None]
    model: ModelSummary
    libraries: dict[str, str]
    settings: dict[str, object] = Field(default_factory=dict, description="what the profiler was asked to measure")
    target: CostCurve = Field(description="target forward pass t(b, n) at settings.context_tokens of context")
    context: ContextCurve | None = Field(
        None, description="how the target's passes scale with cached context (None: not measured, read as flat)"
    )
    prefill: CostCurve = Field(description="prefill of n prompt tokens at batch b")
    drafters: list[DrafterProfile] = Field(default_factory=list)
    acceptance: list[AcceptanceProfile] = Field(default_factory=list)
    samples: list[AcceptanceSample] = Field(default_factory=list)
    predictor: list[PredictorScore] = Field(default_factory=list)
    acceptance_maps: list[AcceptanceMap] = Field(
        default_factory=list, description="per drafter: the per-proposal acceptance predictor, with its calibration"
    )
    quantized: QuantizedProfile | None = Field(None, description="the quantized backend's method, as served")
    quantized_others: list[QuantizedProfile] = Field(
        default_factory=list, description="other quantization methods measured for comparison (not served)"
    )
    acceptance_source: str = Field(
        "measured", description="'measured' here, or where the shipped acceptance (AcceptanceSeed) came from"
    )
    provisional: bool = Field(
        False,
        description="a quick probe's measurements (what `specroute serve` measures before its first answer on a "
        "machine without a profile: each pass timed once, no context curve, drafters not timed in a run, "
        "possibly no quantized backend), to be replaced by the full measurement; `coverage` says what it "
        "holds. False: a full `specroute profile` run",
    )

    @model_validator(mode="after")
    def _usable_target(self) -> Profile:
        # The cost model reads v(b, k) from widths 1..k+1 and the decode-scaling fit needs two batches.
        if self.target.widths != list(range(1, self.target.max_width + 1)):
            raise ValueError(f"target widths must be 1..n without gaps (got {self.target.widths})")
        if len(self.target.batches) < 2:
            raise ValueError("the target curve needs two or more batch sizes")
        return self

    def quantized_method(self, method: str) -> QuantizedProfile | None:
        """The measurement of one quantization method ("auto": the served one), None if not measured."""
        if method == "auto":  # what "auto" resolved to when the profile was measured: a weight-only method
            return self.quantized if self.quantized is not None and self.quantized.method in WEIGHT_ONLY else None
        return next((q for q in [self.quantized, *self.quantized_others] if q is not None and q.method == method), None)

    def serving(self, method: str, drafters: Sequence[str] | None = None) -> Profile:
        """This profile with `method` as the quantized backend's served method (what the cost model
        and the policy read as `quantized`); refuses a method the profile did not measure, except in
        a provisional profile that measured none yet (the policy does not route there until it has).
        `drafters`: the kinds the served quantized backend speculates with (None: as measured); its
        acceptance with others is dropped, so the policy never sends a drafter it does not load."""
        chosen = self.quantized_method(method)
        if chosen is None and self.provisional and self.quantized is None and not self.quantized_others:
            return self
        if chosen is None:
            measured = [q.method for q in [self.quantized, *self.quantized_others] if q is not None]
            raise ProfileError(
                f"the profile has no quantized backend {method!r} measured (measured: {measured or 'none'}): "
                f"run `specroute profile --quantization {method}`"
            )
        others = [q for q in [self.quantized, *self.quantized_others] if q is not None and q is not chosen]
        if drafters is not None:
            kinds = {d.name: d.kind for d in self.drafters}
            kept = [a for a in chosen.acceptance if kinds.get(a.drafter) in drafters]
            chosen = chosen.model_copy(update={"acceptance": kept})
        return self.model_copy(update={"quantized": chosen, "quantized_others": others})

    def pass_seconds(self, batch: float, width: int, context: float | None = None) -> float:
        """A target pass of `width` tokens per sequence at `batch` over `context` cached tokens per
        sequence (None: the context the target curve was measured at)."""
        seconds = self.target.at(batch, width)
        if context is None or self.context is None:
            return seconds
        return seconds * self.context.factor(batch, width, context)

    def drafter(self, name: str) -> DrafterProfile:
        for d in self.drafters:
            if d.name == name or d.kind == name:
                return d
        raise ProfileError(f"the profile has no drafter {name!r} (profiled: {[d.name for d in self.drafters]})")

    def acceptance_for(self, category: str, drafter: str) -> AcceptanceProfile:
        name = self.drafter(drafter).name
        for a in self.acceptance:
            if a.category == category and a.drafter == name:
                return a
        known = sorted({a.category for a in self.acceptance if a.drafter == name})
        raise ProfileError(f"no acceptance measured for category {category!r} with {name} (measured: {known})")

    def proposal_rate(self, drafter: str, category: str | None = None) -> float:
        """ρ for a category, or over every profiled category (weighted by steps) when none is given."""
        if category is not None:
            return self.acceptance_for(category, drafter).proposal_rate
        name = self.drafter(drafter).name
        rows = [a for a in self.acceptance if a.drafter == name and a.steps]
        steps = sum(a.steps for a in rows)
        return sum(a.proposal_rate * a.steps for a in rows) / steps if steps else 1.0

    @property
    def project_samples(self) -> list[AcceptanceSample]:
        """The samples of the profiled prompt set (the training set's only train the predictor)."""
        return [s for s in self.samples if s.prompt_set == "project"]

    def mean_prompt_tokens(self, category: str | None = None) -> int | None:
        """The profiled prompts' mean length in tokens, of one category or of all (None: no samples)."""
        lengths = [s.prompt_tokens for s in self.project_samples if category is None or s.category == category]
        return round(sum(lengths) / len(lengths)) if lengths else None

    @property
    def categories(self) -> list[str]:
        return sorted({a.category for a in self.acceptance})

    def coverage(self) -> str:
        """What the cost curves hold and what the policy reads past them, in a phrase."""
        batches, tries = self.target.batches, self.settings.get("repeats")
        each = ""
        if isinstance(tries, int):  # the profiler's settings say how many tries each pass got
            each = ", one try each" if tries == 1 else f", best of {tries} tries"
        parts = [f"target passes at batches {_span(batches)}{each} (larger ones extrapolated)"]
        if self.context is None:
            parts.append("no context curve (passes read as flat in cached context)")
        parts.append(f"prefill at {_span(self.prefill.widths)} tokens")
        if self.drafters and not self.acceptance_maps:
            parts.append("drafters not timed in a run yet (a draft model's bare pass; prompt lookup as free)")
        if self.quantized is not None:
            parts.append(f"{self.quantized.method} at batches {_span(self.quantized.curve.batches)}")
        else:
            parts.append("no quantized backend measured")
        return ", ".join(parts)

    def provisional_reason(self) -> str | None:
        """The reason every decision made with a provisional profile carries (None: a full one)."""
        if not self.provisional:
            return None
        return f"costs from a provisional profile (a quick probe: {self.coverage()}); the full measurement replaces it"

    def save(self, path: Path) -> None:
        _write(path, self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: Path) -> Profile:
        if not path.is_file():
            raise ProfileError(f"no profile at {path}: measure one with `specroute profile`")
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileError(f"cannot read the profile {path}: {exc}") from None
        except ValidationError as exc:
            if any(e["loc"] == ("version",) for e in exc.errors()):
                raise ProfileError(
                    f"{path} was written by another profile version (this specroute reads version "
                    f"{PROFILE_VERSION}): measure a new one with `specroute profile`"
                ) from None
            raise ProfileError(f"{path} is not a valid profile: {exc}") from None


def _span(values: list[int]) -> str:
    """[1, 2] → '1, 2'; [1, 2, 4, 8, 16] → '1 to 16 (5 sizes)'."""
    if len(values) <= 3:
        return ", ".join(map(str, values))
    return f"{values[0]} to {values[-1]} ({len(values)} sizes)"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(path.suffix + ".tmp")
    staged.write_text(text, encoding="utf-8")
    staged.replace(path)  # a reader never sees half a file
