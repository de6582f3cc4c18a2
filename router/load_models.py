"""What `specroute bench load` is asked to do and what it records: the configuration, the load
levels, one record per request and per join probe."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from profiler.workloads import check_categories

Mode = Literal["auto", "speculative", "plain", "quantized"]
MODES: tuple[Mode, ...] = ("auto", "speculative", "plain", "quantized")
ROUTER: Mode = "auto"
Batching = Literal["continuous", "static"]
OPEN_LOOP_SECONDS = 20.0  # an open-loop level sends about this many seconds of arrivals by default
JOIN_LONG_TOKENS = 192
LoadWorkload = Literal["independent", "shared-prefix", "multi-turn"]
MULTI_TURN_TURNS = 4  # a client's conversation restarts after this many turns (prompts stay bounded)


class LoadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field("http://127.0.0.1:8000", description="base URL of the specroute service")
    api_key: str | None = Field(None, description="sent as a Bearer token when set")
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32], min_length=1)
    request_rates: list[Annotated[float, Field(gt=0, le=1000)]] | None = Field(
        None, description="open loop: Poisson arrivals at each of these requests/s (instead of the concurrency levels)"
    )
    modes: list[Mode] = Field(default_factory=lambda: list(MODES), min_length=1)
    batching: list[Batching] = Field(
        default_factory=lambda: ["continuous"], min_length=1, description="'static' adds the baseline queue's cells"
    )
    requests_per_level: int | None = Field(
        None, ge=1, description="per cell; default max(8, 2 × c), or about 20 s of arrivals"
    )
    max_tokens: int = Field(64, ge=1, le=2048)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    categories: list[str] | None = Field(None, description="prompt categories in the mix (default: all)")
    slo_ttft_ms: float = Field(2000.0, gt=0)
    slo_tpot_ms: float = Field(250.0, gt=0)
    timeout_s: float = Field(300.0, gt=0, description="whole-request deadline, stream included")
    model: str | None = Field(None, description="model id to request (default: the first of GET /v1/models)")
    join_probe: bool = Field(False, description="also time a short request joining a busy backend, per backend")
    seed: int = Field(0, ge=0, description="seeds the open loop's arrival times")
    workload: LoadWorkload = Field(
        "independent",
        description="'independent': each request one prompt of the set; 'shared-prefix': every request begins with "
        "the same long document (a system prompt) before its own prompt; 'multi-turn': each closed-loop client "
        f"holds a conversation — its next turn carries its history and answers — of up to {MULTI_TURN_TURNS} turns",
    )

    _known_categories = field_validator("categories")(check_categories)

    @model_validator(mode="after")
    def _consistent(self) -> LoadConfig:
        if self.workload == "multi-turn" and self.request_rates is not None:
            raise ValueError("workload multi-turn needs closed-loop clients (concurrency), not request_rates")
        for name in ("concurrency", "request_rates"):
            values = getattr(self, name)
            if values is not None and values != sorted(set(values)):
                raise ValueError(f"{name} must be strictly increasing (got {values})")
        for name in ("modes", "batching"):
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"{name} must not repeat (got {getattr(self, name)})")
        return self

    @property
    def open_loop(self) -> bool:
        return self.request_rates is not None

    def levels(self) -> list[Level]:
        if self.request_rates is not None:
            return [Level(request_rate=r) for r in self.request_rates]
        return [Level(concurrency=c) for c in self.concurrency]

    def requests_at(self, level: Level | int) -> int:
        level = level if isinstance(level, Level) else Level(concurrency=level)
        if self.requests_per_level:
            return self.requests_per_level
        if level.request_rate is not None:
            return max(8, math.ceil(level.request_rate * OPEN_LOOP_SECONDS))
        # At least two requests per worker, so every worker's second request meets a loaded server.
        return max(8, 2 * (level.concurrency or 1))


class Level(BaseModel):
    """One load level: a closed loop of `concurrency` clients or an open loop at `request_rate`."""

    model_config = ConfigDict(frozen=True)

    concurrency: int | None = None
    request_rate: float | None = None

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.request_rate is None else f"rate={self.request_rate:g}/s"


class RequestRecord(BaseModel):
    mode: Mode
    batching: Batching = "continuous"
    level: Level
    category: str
    prompt_id: str
    start_s: float = Field(description="seconds after the start of its cell")
    ttft_ms: float | None = Field(description="to the first content token; None when none came")
    tpot_ms: float | None = Field(description="(end − first token) / (completion tokens − 1); None below 2 tokens")
    e2e_ms: float
    completion_tokens: int
    text: str = Field("", description="the content streamed")
    backend: str | None = Field(description="the backend that served it, as the service reported")
    route: dict[str, Any] | None = Field(description="the service's `specroute` object from the final chunk")
    error: str | None = None
    prompt_tokens: int | None = Field(None, description="as the usage chunk said")
    cached_tokens: int | None = Field(None, description="prompt tokens the backend found in its prefix cache")


@dataclass(frozen=True)
class Cell:
    level: Level
    mode: Mode
    batching: Batching
    # Each cell's requests share prefix-cache blocks only among themselves (the service's `cache_salt`):
    # a mode run later must not find the prompts an earlier cell already prefilled.
    cache_salt: str | None = None


class JoinProbe(BaseModel):
    """A short request sent to an idle backend, then again while a long one decodes there."""

    mode: Mode
    batching: Batching
    idle_ttft_ms: float | None
    joined_ttft_ms: float | None = Field(description="its TTFT when it arrived after the long one's first token")
    ttft_ratio: float | None = Field(description="joined over idle: 1 means the long request cost it nothing")
    same_text: bool = Field(description="it streamed exactly the text it got alone")
    long_tokens: int
    error: str | None = None
