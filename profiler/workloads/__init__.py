"""The project's own categorised prompt sets (chat, code, summarization, RAG, translation, math,
QA), written for specroute:

- `project` (prompts.yaml): what the profiler measures acceptance on, fits its predictors and
  acceptance maps on, and everything in the project was developed against;
- `heldout` (heldout.yaml): written separately, with realistic lengths (pasted documents,
  multi-turn chats, code with context), and never tuned on: `bench spec` reports on it by default,
  so what was tuned on one set is checked on the other.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Literal

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


PromptSetName = Literal["project", "heldout"]
PROMPT_SET_FILES: dict[str, str] = {"project": "prompts.yaml", "heldout": "heldout.yaml"}


@cache
def load_prompt_set(name: PromptSetName = "project") -> PromptSet:
    text = files(__package__).joinpath(PROMPT_SET_FILES[name]).read_text(encoding="utf-8")
    return PromptSet.model_validate(yaml.safe_load(text))


def quantization_split(evaluated: int | None = None) -> tuple[list[WorkloadPrompt], list[WorkloadPrompt]]:
    """Prompts that calibrate int8 smoothing and disjoint prompts its quality is measured on:
    alternating prompts of every category, so both halves cover every kind of text. `evaluated`:
    the first that many of each category's evaluation prompts (default: all of them)."""
    calibration, evaluation = [], []
    for category in load_prompt_set().categories.values():
        calibration += category.prompts[0::2]
        evaluation += category.prompts[1::2][:evaluated]
    return calibration, evaluation
