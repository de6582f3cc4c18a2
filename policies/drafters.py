"""The drafter registry: every kind of drafter specroute knows, named once, here.

Each entry says what a kind is called, whether it has trained weights, whether it loads a draft
model of its own, which `DrafterConfig` options it reads, and where the code that builds it lives
(as an import path, so this module stays free of torch). The CLI's choices and flags, the policy
and profile schemas, the predictors, `build_drafter` and `train-drafter` all read it: adding a
drafter is its own module plus one entry below.

A kind is what a user picks (`ngram`); a drafter's *name* is what the engine and the profile call
one built drafter, the kind plus what tells two of that kind apart (`early-exit-4`,
`model:SmolLM2-135M-Instruct@bfloat16`). `kind_of` maps a name back to its kind.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import UserError
from .quantization import REDUCED_PRECISION, WeightOnlyMethod


class DrafterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    summary: str = Field(description="one line for --help and error messages")
    build: str = Field(description="'module:function' taking (DrafterConfig, LoadedModel), returning the drafter")
    options: tuple[str, ...] = Field((), description="the DrafterConfig fields this kind reads")
    trained: bool = Field(False, description="has weights from `specroute train-drafter --kind <kind>`")
    network: str | None = Field(None, description="trained: 'module:Class' of its network (from_card)")
    task: str | None = Field(None, description="trained: 'module:Class' of its training task")
    draft_model: bool = Field(False, description="loads a separate draft model")
    served: bool = Field(False, description="loaded by the service, profiled and allowed by the policy by default")
    benched: bool = Field(True, description="run by `specroute bench spec` by default")
    name: str = Field(
        "{kind}", description="the engine's name for one built drafter: formatted with the options and `detail`"
    )
    baseline: Literal["prompt_lookup", "assistant"] | None = Field(
        None, description="transformers' own assisted decoding this kind faces in `bench spec`"
    )


_SPEC = "backends.speculative"
REGISTRY: tuple[DrafterSpec, ...] = (
    DrafterSpec(
        kind="ngram",
        summary="prompt lookup: propose what followed the longest earlier match of the suffix",
        build=f"{_SPEC}.drafters:build_ngram",
        options=("ngram_max", "ngram_min"),
        served=True,
        baseline="prompt_lookup",
    ),
    DrafterSpec(
        kind="model",
        summary="a small draft model with the target's tokenizer",
        build=f"{_SPEC}.drafters:build_model_drafter",
        options=("draft_model", "draft_dtype"),
        name="{kind}:{detail}",  # detail: the draft model's name@dtype
        draft_model=True,
        served=True,
        baseline="assistant",
    ),
    DrafterSpec(
        kind="early-exit",
        summary="the target's own first layers, untrained (self-speculation)",
        build=f"{_SPEC}.drafters:build_early_exit",
        options=("exit_layer",),
        name="{kind}-{exit_layer}",
        benched=False,
    ),
    DrafterSpec(
        kind="lookahead",
        summary="lookahead decoding: the target's own Jacobi window, run in the verifying pass, yields n-grams",
        build=f"{_SPEC}.lookahead:build_lookahead",
        options=("lookahead_window", "lookahead_ngram", "lookahead_guesses"),
        name="{kind}-{lookahead_window}x{lookahead_ngram}x{lookahead_guesses}",
        benched=False,  # its default block is wider than bfloat16's default tile: `--drafters lookahead` asks
    ),
    DrafterSpec(
        kind="eagle",
        summary="a trained EAGLE head drafting on the target's features",
        build=f"{_SPEC}.trained_drafters:build_eagle",
        options=("weights", "draft_dtype"),
        trained=True,
        network=f"{_SPEC}.trained:EagleNet",
        task="backends.training.loops:EagleTask",
    ),
    DrafterSpec(
        kind="medusa",
        summary="trained Medusa heads, one per draft position",
        build=f"{_SPEC}.trained_drafters:build_medusa",
        options=("weights", "draft_dtype"),
        trained=True,
        network=f"{_SPEC}.trained:MedusaNet",
        task="backends.training.loops:MedusaTask",
    ),
    DrafterSpec(
        kind="early-exit-adapter",
        summary="the target's first layers with a trained adapter before its head",
        build=f"{_SPEC}.trained_drafters:build_adapter",
        options=("weights",),
        trained=True,
        network=f"{_SPEC}.trained:ExitAdapter",
        task="backends.training.loops:ExitTask",
    ),
)

KINDS: tuple[str, ...] = tuple(s.kind for s in REGISTRY)
TRAINED_KINDS: tuple[str, ...] = tuple(s.kind for s in REGISTRY if s.trained)
SERVED_KINDS: tuple[str, ...] = tuple(s.kind for s in REGISTRY if s.served)
BENCHED_KINDS: tuple[str, ...] = tuple(s.kind for s in REGISTRY if s.benched)
# Built from the registry at import time; pydantic validates against it like a written-out Literal.
DrafterKind = Literal[KINDS]  # type: ignore[valid-type]
TrainedKind = Literal[TRAINED_KINDS]  # type: ignore[valid-type]


class UnknownKindError(UserError, KeyError):
    """A drafter kind the registry does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def spec(kind: str) -> DrafterSpec:
    for entry in REGISTRY:
        if entry.kind == kind:
            return entry
    raise UnknownKindError(f"unknown drafter kind {kind!r}: pick one of {', '.join(KINDS)}")


def kind_of(name: str) -> str:
    """The kind of an engine drafter name: 'model' for 'model:SmolLM2-135M-Instruct@bfloat16',
    'early-exit' for 'early-exit-4'; a name of no known kind is its own kind."""
    for kind in sorted(KINDS, key=len, reverse=True):  # 'early-exit-adapter' is no 'early-exit-<n>'
        if name == kind or name.startswith((kind + ":", kind + "-")):
            return kind
    return name


def resolve(path: str) -> Any:
    """The object an entry's 'module:attribute' path names (imported on first use)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


class DrafterConfig(BaseModel):
    """Which drafter to build and its options; each kind reads only the options its entry lists.
    The CLI's drafter flags are these fields (`flag` names the ones not spelled `--field-name`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: DrafterKind = Field(KINDS[0], description="which drafter (the registry's name: ngram, model, eagle, ...)")
    ngram_max: int = Field(4, ge=1, le=16, description="longest suffix n-gram prompt lookup tries")
    ngram_min: int = Field(2, ge=1, le=16, description="shortest suffix n-gram prompt lookup accepts")
    draft_model: str = Field("embedded", description="the draft model: 'embedded', a directory, a .gguf or a HF id")
    draft_dtype: Literal["auto", "float32", "bfloat16", WeightOnlyMethod] = Field(
        "auto",
        description="dtype of a draft model or of trained heads; a draft model may also run weight-only quantized "
        "(int8-weight-only, int4-weight-only: loaded in float32, then quantized). auto: bfloat16, except a draft "
        "model under a bfloat16/float16 target, which runs weight-only quantized (the method its weights fit)",
    )
    exit_layer: int = Field(4, ge=1, description="how many of the target's layers the untrained early exit uses")
    lookahead_window: int = Field(4, ge=1, le=32, description="lookahead: Jacobi window width W (columns)")
    lookahead_ngram: int = Field(
        3, ge=2, le=8, description="lookahead: n-gram size N (the window has N − 1 levels; candidates N − 1 tokens)"
    )
    lookahead_guesses: int = Field(
        4,
        ge=1,
        le=32,
        description="lookahead: most candidate n-grams G verified per step (a pass is 1 + (W + G)(N − 1) wide)",
    )
    weights: str = Field(
        "default",
        description="trained drafters: 'default' (shipped for the embedded model), a directory from "
        "`specroute train-drafter`, or a .safetensors file",
        json_schema_extra={"flag": "--drafter-weights"},
    )

    @model_validator(mode="after")
    def _ngram_range(self) -> DrafterConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        return self

    def draft_dtype_under(self, target_dtype: str) -> str | None:
        """`draft_dtype` for a target in `target_dtype`, 'auto' resolved: bfloat16, except for a draft
        model under a reduced-precision target, where a bfloat16 copy would cost what the target does:
        None there, meaning weight-only quantized by the method the weights fit (decided where the
        weights are)."""
        if self.draft_dtype != "auto":
            return self.draft_dtype
        if self.kind == "model" and target_dtype in REDUCED_PRECISION:
            return None
        return "bfloat16"

    def of(self, kind: str) -> DrafterConfig:
        """These options for another kind."""
        return self.model_copy(update={"kind": spec(kind).kind})


def option_kinds(option: str) -> list[str]:
    """The kinds that read one DrafterConfig option (for its --help)."""
    return [s.kind for s in REGISTRY if option in s.options]


def drafter_name(config: DrafterConfig, detail: str = "") -> str:
    """The engine's name for a built drafter: the kind, plus what tells two of that kind apart."""
    return spec(config.kind).name.format(**config.model_dump(), detail=detail)
