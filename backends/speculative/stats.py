"""Speculation counters with vLLM's meaning: a *draft* is one speculative step of one sequence,
acceptance rate = accepted / drafted tokens, mean accepted length = 1 + accepted / drafts. Beside
them the cost model's α: accepted tokens over tokens *judged* on steps with a proposal (accepted +
the first rejected or missing one)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field, computed_field


class SpeculationStats(BaseModel):
    drafter: str
    k_mode: str = Field(description="'auto' (chosen per step) or the fixed k")
    steps: int = Field(0, description="target passes after the prefill")
    drafts: int = Field(0, description="steps that verified at least one drafted token")
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = Field(default_factory=list, description="[j]: drafts whose token j was accepted")
    requested_steps: int = Field(0, description="sequence-steps that asked the drafter for at least one token")
    judged_tokens: int = Field(
        0,
        description="on steps with a proposal: accepted tokens + one per step that stopped short of its k "
        "(a rejection, or a proposal shorter than asked)",
    )
    declined_tokens: int = Field(0, description="drafted tokens auto k chose not to verify (their gain did not pay)")
    draft_time_s: float = 0.0
    verify_time_s: float = Field(0.0, description="target passes that verified drafts")
    target_step_s: float = Field(0.0, description="measured 1-token target pass at this batch size")
    k_history: list[int] = Field(default_factory=list, description="drafted tokens verified at each step")
    width_history: list[int] = Field(
        default_factory=list, description="positions of each step's target pass (a structured block's, or padded)"
    )

    @computed_field
    @property
    def acceptance_rate(self) -> float:
        """vLLM's acceptance rate: accepted / drafted tokens (a short proposal is judged on what it drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @computed_field
    @property
    def alpha(self) -> float:
        """The cost model's per-token α on steps with a proposal: accepted / judged. A proposal shorter
        than the k asked for counts its first missing token as rejected (the step ends there), unlike
        `acceptance_rate`. Steps with no proposal at all are the proposal rate's business."""
        return self.accepted_tokens / self.judged_tokens if self.judged_tokens else 0.0

    @computed_field
    @property
    def proposal_rate(self) -> float:
        """Share of the steps that asked for drafts in which the drafter proposed at least one token."""
        return self.drafts / self.requested_steps if self.requested_steps else 0.0

    @computed_field
    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per step that asked for drafts, proposal or not: what the cost model's
        1 + ρ·(E(α, k) − 1) predicts (mean accepted length counts only steps with a proposal)."""
        return 1.0 + self.accepted_tokens / self.requested_steps if self.requested_steps else 1.0

    @computed_field
    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative step: accepted drafts + the target's own token."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @computed_field
    @property
    def gamma(self) -> float:
        """Drafting time per speculative step over one target step (k·c in the cost model)."""
        if not self.drafts or self.target_step_s <= 0:
            return 0.0
        return self.draft_time_s / self.drafts / self.target_step_s

    @classmethod
    def combined(cls, parts: Sequence[SpeculationStats]) -> SpeculationStats:
        """Several requests' stats as one: counts and times add up, the target step is their mean."""
        positions = max((len(p.accepted_per_position) for p in parts), default=0)
        return cls(
            drafter=parts[0].drafter,
            k_mode=parts[0].k_mode,
            steps=sum(p.steps for p in parts),
            drafts=sum(p.drafts for p in parts),
            draft_tokens=sum(p.draft_tokens for p in parts),
            accepted_tokens=sum(p.accepted_tokens for p in parts),
            requested_steps=sum(p.requested_steps for p in parts),
            judged_tokens=sum(p.judged_tokens for p in parts),
            declined_tokens=sum(p.declined_tokens for p in parts),
            accepted_per_position=[
                sum(p.accepted_per_position[j] for p in parts if j < len(p.accepted_per_position))
                for j in range(positions)
            ],
            draft_time_s=sum(p.draft_time_s for p in parts),
            verify_time_s=sum(p.verify_time_s for p in parts),
            target_step_s=sum(p.target_step_s for p in parts) / len(parts),
            k_history=[k for p in parts for k in p.k_history],
            width_history=[w for p in parts for w in p.width_history],
        )

    def record(
        self,
        k: int,
        drafted: Sequence[int],
        accepted: Sequence[int],
        draft_s: float,
        verify_s: float,
        requested: Sequence[int] | None = None,
        declined: int = 0,
        width: int | None = None,
    ) -> None:
        """One target pass: the k used (drafted tokens verified), and per sequence in the pass its
        drafted and accepted counts and the k it asked for (default: k for every sequence); the
        pass's width (default k + 1)."""
        for asked, count, ok in zip(requested or [k] * len(drafted), drafted, accepted, strict=True):
            if asked:
                self.requested_steps += 1
            if asked and count:
                self.judged_tokens += ok + (1 if ok < asked else 0)
        self.steps += 1
        self.declined_tokens += declined
        self.k_history.append(k)
        self.width_history.append(k + 1 if width is None else width)
        self.draft_time_s += draft_s
        if any(drafted):
            self.verify_time_s += verify_s
        for count, ok in zip(drafted, accepted, strict=True):
            if count:
                self._record_draft(count, ok)

    def _record_draft(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def summary(self) -> str:
        ks = sorted(set(self.k_history))
        k_text = f"k={self.k_mode}" + (f" (used {ks[0]}..{ks[-1]})" if len(ks) > 1 else f" ({ks[0]})" if ks else "")
        return (
            f"[{self.drafter}] {k_text} · {self.drafts} drafts, {self.accepted_tokens}/{self.draft_tokens} accepted"
            + (f" ({self.declined_tokens} more drafted, not worth verifying)" if self.declined_tokens else "")
            + " · "
            f"acceptance {self.acceptance_rate:.2f} · α {self.alpha:.2f} · "
            f"mean accepted length {self.mean_accepted_length:.2f} · "
            f"γ {self.gamma:.3f} · draft {self.draft_time_s * 1e3:.0f} ms, verify {self.verify_time_s * 1e3:.0f} ms"
        )
