"""What a decode engine takes and returns, and the per-sequence bookkeeping every engine shares:
when a sequence stops (EOS, a stop string, max_tokens) and what text it produced.

Engines append tokens one at a time through `SequenceState.append`, so a speculative engine that
accepts a block of drafted tokens never emits past a stop condition inside that block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from transformers import PreTrainedTokenizerBase

from .sampling import SamplingParams
from .speculative.stats import SpeculationStats

FinishReason = Literal["stop", "length"]
# Called with the sequence and each token id right after it is appended (`state.finished` is
# already set when that token ended it): how engines stream while they run.
TokenListener = Callable[["SequenceState", int], None]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"] = Field(description="who says it, as in OpenAI's chat format")
    content: str = Field(description="the message's text")


class GenerationRequest(BaseModel):
    """One completion: either a raw `prompt` or chat `messages` (rendered by the chat template)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    max_tokens: int = Field(128, ge=1, description="upper bound on generated tokens")
    stop: list[str] = Field(default_factory=list, description="generation ends before any of these")
    ignore_eos: bool = Field(False, description="keep generating past EOS (benchmarks)")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    resume_ids: list[int] = Field(
        default_factory=list,
        description="tokens an earlier attempt already generated: decoding resumes after them (a retry)",
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="prefix-cache isolation: cached prompt blocks are shared only among requests of the same salt",
    )
    prompt_ids: list[int] | None = Field(
        None,
        min_length=1,
        description="the prompt as the router tokenized it (chat template applied): a backend feeds these instead "
        "of tokenizing again, and the replica router reads its prefix from them",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _single_stop(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    def text_and_turns(self) -> tuple[str, int]:
        """The prompt's text as written (message contents joined by newlines) and its number of
        messages: what the α predictor reads, before any chat template."""
        if self.messages is not None:
            return "\n".join(m.content for m in self.messages), len(self.messages)
        return self.prompt or "", 1

    @model_validator(mode="after")
    def _one_input(self) -> GenerationRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class GenerationResult(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float = Field(description="request start to first generated token (includes prefill)")
    tpot_s: float = Field(description="mean time per output token after the first")
    seed: int = Field(description="seed of this request's generator (reuse it to reproduce a sample)")
    speculation: SpeculationStats | None = Field(None, description="drafting and acceptance, when speculative")
    cached_tokens: int = Field(0, ge=0, description="prompt tokens found in the prefix cache, not prefilled")

    @property
    def tokens_per_s(self) -> float:
        decode_time = self.ttft_s + self.tpot_s * max(self.completion_tokens - 1, 0)
        return self.completion_tokens / decode_time if decode_time > 0 else 0.0


@dataclass
class SequenceState:
    """A request in flight: its tokens so far and whether (and why) it has finished."""

    request: GenerationRequest
    prompt_ids: list[int]
    eos_ids: Collection[int]
    seed: int
    started_at: float
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    listener: TokenListener | None = None  # streams tokens out while the engine runs
    speculation: SpeculationStats | None = None  # the speculative engine's live statistics of this row
    cached_tokens: int = 0  # prompt tokens found in the prefix cache instead of prefilled
    _stop_cut: int | None = None  # character offset where a stop string begins
    _searched_chars: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, tokenizer: PreTrainedTokenizerBase) -> bool:
        """Record one generated token; return True when the sequence has finished."""
        now = time.perf_counter()
        self.token_ids.append(token)
        self.first_token_at = self.first_token_at or now
        if token in self.eos_ids and not self.request.ignore_eos:
            self.finish_reason = "stop"
        elif self.request.stop and self._hit_stop_string(tokenizer):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.request.max_tokens:
            self.finish_reason = "length"
        if self.finished:
            self.finished_at = now
        if self.listener is not None:
            self.listener(self, token)
        return self.finished

    def result(self, tokenizer: PreTrainedTokenizerBase) -> GenerationResult:
        text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self._stop_cut is not None:
            text = text[: self._stop_cut]
        first = self.first_token_at or self.started_at
        finished = self.finished_at or first
        count = len(self.token_ids)
        return GenerationResult(
            text=text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason or "length",
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=count,
            ttft_s=first - self.started_at,
            tpot_s=(finished - first) / (count - 1) if count > 1 else 0.0,
            seed=self.seed,
            speculation=self.speculation,
            cached_tokens=self.cached_tokens,
        )

    def _hit_stop_string(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        # Only the new tail (plus room for a stop string straddling it) needs searching.
        start = max(0, min(self._searched_chars, len(text)) - max(len(s) for s in self.request.stop) + 1)
        hits = [i for i in (text.find(s, start) for s in self.request.stop) if i >= 0]
        # A character split across byte-level tokens decodes as U+FFFD until its last byte
        # arrives: those placeholders are not searched text yet.
        self._searched_chars = len(text.rstrip("\ufffd"))
        if hits:
            self._stop_cut = min(hits)
        return bool(hits)


def listener_for(listeners: Sequence[TokenListener | None] | None, index: int, count: int) -> TokenListener | None:
    """The listener of request `index` out of `count`, checking the list matches the requests."""
    if listeners is None:
        return None
    if len(listeners) != count:
        raise ValueError(f"{len(listeners)} listeners for {count} requests")
    return listeners[index]
