"""The project's own categorised prompt set (chat, code, summarization, RAG, translation, math,
QA), written for specroute: what `bench spec` and the profiler measure acceptance on."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import yaml
from pydantic import BaseModel, ConfigDict, Field

from backends.generation import ChatMessage


class WorkloadPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    messages: list[ChatMessage] = Field(min_length=1)


class Category(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str
    prompts: list[WorkloadPrompt] = Field(min_length=1)


class PromptSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int
    categories: dict[str, Category]


def check_categories(categories: list[str] | None) -> list[str] | None:
    """A validator for configs that name categories: every one must exist in the prompt set."""
    known = load_prompt_set().categories
    unknown = [c for c in categories or [] if c not in known]
    if unknown:
        raise ValueError(f"unknown categories {unknown} (the prompt set has {', '.join(known)})")
    return categories


@cache
def load_prompt_set() -> PromptSet:
    text = files(__package__).joinpath("prompts.yaml").read_text(encoding="utf-8")
    return PromptSet.model_validate(yaml.safe_load(text))


def quantization_split() -> tuple[list[WorkloadPrompt], list[WorkloadPrompt]]:
    """Prompts that calibrate int8 smoothing and disjoint prompts its quality is measured on:
    alternating prompts of every category, so both halves cover every kind of text."""
    prompts = [p for category in load_prompt_set().categories.values() for p in category.prompts]
    return prompts[0::2], prompts[1::2]
