"""Building a drafter from a small pydantic config: what the CLI and the service both use."""

from __future__ import annotations

from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import ModelLoadError
from ..models import LoadedModel, load_model, resolve_dtype
from .drafters import Drafter, ModelDrafter, NgramDrafter, early_exit_model
from .trained import TrainedKind, load_drafter, resolve_weights
from .trained_drafters import EagleDrafter, MedusaDrafter, adapter_drafter

DrafterKind = Literal["ngram", "model", "early-exit", "eagle", "medusa", "early-exit-adapter"]
TRAINED_KINDS = ("eagle", "medusa", "early-exit-adapter")


class DrafterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: DrafterKind = "ngram"
    ngram_max: int = Field(4, ge=1, le=16, description="longest suffix n-gram prompt lookup tries")
    ngram_min: int = Field(2, ge=1, le=16, description="shortest suffix n-gram prompt lookup accepts")
    draft_model: str = Field("embedded", description="model drafter: 'embedded', a directory, a .gguf or a HF id")
    draft_dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="model drafter's dtype")
    exit_layer: int = Field(4, ge=1, description="early exit: how many of the target's layers draft")
    weights: str = Field(
        "default",
        description="trained drafters (eagle, medusa, early-exit-adapter): 'default' (shipped for the embedded "
        "model), a directory from `specroute train-drafter`, or a .safetensors file",
    )

    @model_validator(mode="after")
    def _ngram_range(self) -> DrafterConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        return self


def build_drafter(config: DrafterConfig, target: LoadedModel) -> Drafter:
    vocab = target.model.get_output_embeddings().weight.shape[0]
    if config.kind == "ngram":
        return NgramDrafter(max_n=config.ngram_max, min_n=config.ngram_min)
    if config.kind in TRAINED_KINDS:
        return _trained_drafter(config, target)
    if config.kind == "early-exit":
        drafter = ModelDrafter(early_exit_model(target.model, config.exit_layer), vocab)
        drafter.name = f"early-exit-{config.exit_layer}"
        return drafter
    draft = load_model(config.draft_model, dtype=config.draft_dtype, device=target.info.device)
    if draft.info.name == target.info.name and draft.info.dtype == target.info.dtype:
        raise ModelLoadError(
            "the draft model is the target itself in the same dtype, which can never be faster: "
            "pick a smaller model with the same tokenizer, or draft in bfloat16 (draft_dtype)"
        )
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ModelLoadError(
            f"the draft model {config.draft_model!r} has a different tokenizer from the target: "
            "a drafter must share the target's vocabulary"
        )
    drafter = ModelDrafter(draft.model, vocab)
    drafter.name = f"model:{draft.info.name}@{draft.info.dtype}"
    return drafter


def _trained_drafter(config: DrafterConfig, target: LoadedModel) -> Drafter:
    """EAGLE and Medusa run in `draft_dtype` (their own small weights); the adapter runs in the
    target's dtype because it shares the target's layers."""
    kind = cast(TrainedKind, config.kind)
    path = resolve_weights(config.weights, kind, target.info.name)
    dtype = resolve_dtype(target.info.dtype if kind == "early-exit-adapter" else config.draft_dtype)
    trained = load_drafter(path, target.model, target.tokenizer, dtype)
    if kind == "eagle":
        return EagleDrafter(trained)
    if kind == "medusa":
        return MedusaDrafter(trained)
    return adapter_drafter(target.model, trained)
