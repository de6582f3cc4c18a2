"""OpenAI-compatible request and response bodies, plus specroute's `specroute` extension.

Requests are strict: a field OpenAI defines but this service cannot honour (n > 1, logprobs,
penalties, tools) is refused with a 400 naming it, rather than silently ignored; unknown fields
are refused too (OpenAI does the same). Responses follow OpenAI's shapes; every one carries
`specroute` (backend, drafter, k, reasons, measured α and accepted tokens for the request).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.generation import ChatMessage, GenerationRequest
from backends.sampling import SamplingParams

ForcedBackend = Literal["auto", "speculative", "plain", "quantized"]
# Per-field limits (the service's own, request-size ones are `router.core.Limits`).
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_USER_CHARS = 256
MAX_SALT_CHARS = 256
MAX_NAME_CHARS = 64
MAX_CATEGORY_CHARS = 64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpecrouteOptions(_Strict):
    """The request's `specroute` field (with the openai client: `extra_body={"specroute": {...}}`)."""

    backend: ForcedBackend = Field("auto", description="'auto': the policy decides; otherwise that backend serves")
    drafter: str | None = Field(None, description="speculative only: the drafter to use (default: the policy's)")
    category: str | None = Field(
        None, max_length=MAX_CATEGORY_CHARS, description="the prompt's category, if known: sharpens the α prediction"
    )
    batching: Literal["continuous", "static"] = Field(
        "continuous",
        description="'static': the baseline engine queue (batches run to completion), for benchmarks only",
    )


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=2**63 - 1, description="specroute extension; 0 = no limit")  # a torch int64
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="penalties are not supported")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="penalties are not supported")
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_SALT_CHARS,
        description="prefix-cache isolation (vLLM's field): cached prompt blocks are shared only among requests "
        "with the same salt, so one tenant's prompts cannot be probed through another's time to first token",
    )
    specroute: SpecrouteOptions = Field(default_factory=SpecrouteOptions)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters long")
        return stops

    @model_validator(mode="after")
    def _usage_needs_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)


class ChatMessageIn(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="not supported")
    tools: list[dict[str, Any]] | None = Field(None, max_length=0, description="not supported")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool) -> bool:
        if value:
            raise ValueError("logprobs are not supported by this service")
        return value

    @model_validator(mode="after")
    def _messages(self) -> ChatCompletionRequest:
        for m in self.messages:
            m.text()  # raises on non-text parts
        return self

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def generation(self, max_tokens: int) -> GenerationRequest:
        messages = [
            ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text()) for m in self.messages
        ]
        return GenerationRequest(
            messages=messages,
            max_tokens=max_tokens,
            stop=self.stop,
            sampling=self.sampling(),
            cache_salt=self.cache_salt,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)
    echo: bool = Field(False, description="not supported")
    logprobs: int | None = Field(None, description="not supported")
    suffix: str | None = Field(None, description="not supported")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        prompts = [value] if isinstance(value, str) else value
        if len(prompts) != 1:
            raise ValueError("exactly one prompt per request (send several requests for several prompts)")
        if not prompts[0]:
            raise ValueError("the prompt is empty")
        return prompts[0]

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name) not in (None, False):
                raise ValueError(f"{name} is not supported by this service")
        return self

    def limit(self, default: int) -> int:
        return self.max_tokens

    def generation(self, max_tokens: int) -> GenerationRequest:
        assert isinstance(self.prompt, str)
        return GenerationRequest(
            prompt=self.prompt,
            max_tokens=max_tokens,
            stop=self.stop,
            sampling=self.sampling(),
            cache_salt=self.cache_salt,
        )


class SpecrouteInfo(BaseModel):
    """How the request was served and what speculation achieved on it."""

    backend: str
    drafter: str | None = None
    k: int | None = Field(None, description="drafted tokens per step the policy planned (the engine adapts k)")
    stage: str = Field(
        description="the policy stage that decided: speculation, batching, quantization, exploration (a backend "
        "this service had not measured enough at this load) or forced"
    )
    reasons: list[str]
    concurrency: int = Field(description="requests in flight when it was routed, itself included")
    alpha: float | None = Field(None, description="measured: accepted / judged draft tokens")
    predicted_alpha: float | None = None
    accepted_tokens: int | None = None
    draft_tokens: int | None = None
    mean_accepted_length: float | None = None
    retried: bool = Field(
        False,
        description="a backend failed mid-request and another finished it, or answered 429 (full) and the "
        "next-best backend served the request instead (the reasons say which)",
    )
    weights: str | None = Field(
        None, description="what the backend's target computes in: the served dtype or the method"
    )
    ttft_ms: float | None = None
    tpot_ms: float | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache (not prefilled)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
