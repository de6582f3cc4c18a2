"""The workload a capacity-planning report plans for (`specroute report --workload W.yaml`): what
the users send (a mix of prompt categories, or a file of real prompts), how long prompts and
answers are, how much load arrives, the latency targets, and what a replica costs.

Read from YAML like the policy and validated the same way: every mistake at once, one line each,
as `<dotted.path>: <what is wrong>`. Which categories exist is not this file's to know — the
profile measured them — so `load_workload` takes them and refuses a category the profile lacks.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .config import RULE_ERROR, StrictLoader, describe_error, yaml_problem
from .errors import UserError
from .estimates import BACKENDS

# What a replica costs when the workload names no price: one machine like the profiled one, each
# core at this on-demand price. An assumption the report labels as such, never a measurement.
ASSUMED_CORE_HOUR_USD = 0.04
SHARE_TOLERANCE = 1e-6
PRICED = ("auto", *BACKENDS)  # "auto": one replica of the routed service (its three backends on one machine)


class WorkloadError(UserError):
    """A workload file that cannot be used; the message lists every problem, one per line."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source, self.problems = source, tuple(problems)
        super().__init__(f"{source}: invalid workload\n" + "\n".join(f"  {p}" for p in self.problems))

    def __reduce__(self) -> tuple[type[WorkloadError], tuple[str, tuple[str, ...]]]:
        return type(self), (self.source, self.problems)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Lengths(_Section):
    """A token-length distribution: fixed, uniform on [min, max], or log-normal with this mean,
    cut to [min, max] (long tails are what queues feel)."""

    distribution: Literal["fixed", "uniform", "lognormal"] = Field("lognormal", description="shape of the lengths")
    mean: float = Field(gt=0, description="mean length in tokens (fixed: the length)")
    min: int = Field(1, ge=1, description="shortest length")
    max: int = Field(2048, ge=1, description="longest length")
    sigma: float = Field(0.6, gt=0, le=3, description="log-normal shape: the standard deviation of log(length)")

    @model_validator(mode="after")
    def _ordered(self) -> Lengths:
        if self.max < self.min:
            raise PydanticCustomError(RULE_ERROR, f"max ({self.max}) must be at least min ({self.min})")
        if not self.min <= self.mean <= self.max:
            raise PydanticCustomError(RULE_ERROR, f"mean ({self.mean:g}) must lie within [min, max]")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n integer lengths."""
        if self.distribution == "fixed":
            values = np.full(n, self.mean)
        elif self.distribution == "uniform":
            values = rng.uniform(self.min, self.max, n)
        else:  # log-normal whose mean is `mean` before clipping
            values = rng.lognormal(math.log(self.mean) - self.sigma**2 / 2, self.sigma, n)
        return np.clip(np.rint(values), self.min, self.max).astype(int)


class Load(_Section):
    """Either an open loop (requests arrive as a Poisson process at `arrival_rate`) or a range of
    concurrency (that many clients, each sending the next request when its last one ends)."""

    arrival_rate: float | None = Field(None, gt=0, le=1e6, description="requests per second (Poisson arrivals)")
    concurrency: list[Annotated[int, Field(ge=1, le=100_000)]] | None = Field(
        None, min_length=2, max_length=2, description="[lowest, highest] clients in flight to plan for"
    )

    @model_validator(mode="after")
    def _one(self) -> Load:
        if (self.arrival_rate is None) == (self.concurrency is None):
            raise PydanticCustomError(RULE_ERROR, "give exactly one of arrival_rate and concurrency")
        if self.concurrency is not None and self.concurrency[0] > self.concurrency[1]:
            raise PydanticCustomError(
                RULE_ERROR, f"must be [lowest, highest] (got {self.concurrency})", {"path": "load.concurrency"}
            )
        return self


class WorkloadSLO(_Section):
    """A request meets the SLO when its TTFT and time per output token are under target; the load
    meets it when `attainment` of its requests do and the e2e p99 is under its target."""

    ttft_ms: float = Field(2000.0, gt=0, description="time-to-first-token target (ms)")
    tpot_ms: float = Field(250.0, gt=0, description="time-per-output-token target (ms)")
    e2e_p99_ms: float | None = Field(None, gt=0, description="99th-percentile end-to-end latency target (ms)")
    attainment: float = Field(0.99, gt=0, le=1, description="share of requests that must meet the TTFT and TPOT goals")


class Pricing(_Section):
    """What a replica costs per hour; one without a price is a machine like the profiled one:
    `cores` × `core_hour_usd`."""

    replica_hour_usd: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="$ per replica-hour per backend (speculative, plain, quantized) or for the routed service (auto)",
    )
    core_hour_usd: float = Field(ASSUMED_CORE_HOUR_USD, gt=0, description="$ per core-hour for unpriced backends")
    cores: int | None = Field(None, ge=1, description="cores per replica (default: the profiled machine's)")

    @field_validator("replica_hour_usd")
    @classmethod
    def _backends(cls, prices: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(prices) - set(PRICED))
        if unknown:
            known = ", ".join(PRICED)
            raise PydanticCustomError(RULE_ERROR, f"unknown backend {', '.join(unknown)} (known: {known})")
        return prices


class WhatIf(_Section):
    replicas: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=lambda: [1, 2, 4], min_length=1, description="replica counts to simulate"
    )
    load_factors: list[Annotated[float, Field(gt=0, le=1000)]] = Field(
        default_factory=lambda: [1.0, 10.0], min_length=1, description="multiples of the workload's load"
    )


class Workload(_Section):
    version: Literal[1] = Field(1, description="schema version of this file")
    name: str = Field("workload", min_length=1, description="shown in the report's title")
    mix: dict[str, Annotated[float, Field(ge=0, le=1)]] | None = Field(
        None, description="prompt category → share of requests (shares sum to 1)"
    )
    prompts: str | None = Field(
        None, description="a JSONL file of real prompts (one OpenAI chat request per line), instead of mix"
    )
    input_tokens: Lengths | None = Field(None, description="prompt lengths (default: the profiled prompts' lengths)")
    shared_prefix: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="tokens every request's prompt begins with (a system prompt, few-shot examples, a shared "
        "document), added to each drawn prompt (with `prompts`, the first this many tokens of each): a replica's "
        "prefix cache serves them once it has prefilled one",
    )
    output_tokens: Lengths = Field(
        default_factory=lambda: Lengths(mean=128, max=512), description="answer lengths in tokens"
    )
    load: Load = Field(description="how much load arrives")
    slo: WorkloadSLO = Field(default_factory=WorkloadSLO, description="latency targets")
    pricing: Pricing = Field(default_factory=Pricing, description="what a replica costs")
    what_if: WhatIf = Field(default_factory=WhatIf, description="what the simulation also tries")

    @field_validator("mix")
    @classmethod
    def _mix(cls, mix: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        if mix is None:
            return None
        if not mix:
            raise PydanticCustomError(RULE_ERROR, "needs at least one category")
        known = (info.context or {}).get("categories")
        for name in mix:
            if known is not None and name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise PydanticCustomError(
                    RULE_ERROR,
                    f"unknown category (the profile measured: {', '.join(known)}){hint}",
                    {"path": f"mix.{name}"},
                )
        total = sum(mix.values())
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise PydanticCustomError(RULE_ERROR, f"shares must sum to 1 (they sum to {total:g})")
        return mix

    @model_validator(mode="after")
    def _one_source(self) -> Workload:
        if (self.mix is None) == (self.prompts is None):
            raise PydanticCustomError(
                RULE_ERROR,
                "give exactly one of mix (category shares) and prompts (a JSONL file)",
                {"path": "mix, prompts"},
            )
        return self


def parse_workload(data: object, categories: Sequence[str] | None = None, source: str = "workload") -> Workload:
    """Validate parsed YAML; `categories` (the profile's) lets unknown categories be refused."""
    if not isinstance(data, Mapping):
        raise WorkloadError(source, [f"the top level must be a mapping with keys {', '.join(Workload.model_fields)}"])
    try:
        context = {"categories": list(categories)} if categories is not None else None
        return Workload.model_validate(data, context=context)
    except ValidationError as exc:
        raise WorkloadError(source, [describe_error(e, Workload) for e in exc.errors()]) from None


def load_workload(path: str | Path, categories: Sequence[str] | None = None) -> Workload:
    """Read, parse and validate a workload file; a relative `prompts` path is resolved beside it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(str(path), ["file not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(str(path), [f"cannot be read: {exc}"]) from None
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except yaml.MarkedYAMLError as exc:
        raise WorkloadError(str(path), [yaml_problem(exc)]) from None
    except yaml.YAMLError as exc:
        raise WorkloadError(str(path), [f"not valid YAML: {exc}"]) from None
    workload = parse_workload(data, categories, source=str(path))
    if workload.prompts is not None and not Path(workload.prompts).is_absolute():
        workload = workload.model_copy(update={"prompts": str(path.parent / workload.prompts)})
    return workload
