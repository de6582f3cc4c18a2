"""The one place that turns logits into the target distribution p and draws from it.

The plain engine and the speculative engine both sample only through this module, so
"lossless" is checked against the very distribution the plain engine samples from.
Temperature 0 means greedy: p is one-hot at the argmax (ties go to the lowest id, as in
`torch.argmax` and transformers' greedy search).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """Per-request sampling settings; `seed=None` draws a fresh seed for the request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="0 = greedy; higher flattens p")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = no limit")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="keep the smallest set with this much mass")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="seeds this request's own generator")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def new_generator(seed: int | None, device: str | torch.device = "cpu") -> tuple[torch.Generator, int]:
    """A request's own generator, so its draws never depend on what it is batched with."""
    seed = secrets.randbits(63) if seed is None else seed
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator, seed


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Target distribution p for each row: logits (B, V) or (B, T, V) -> float32 probs, same shape.

    Row b uses params[b] at every one of its T positions.
    """
    if logits.dim() == 3:
        batch, steps, vocab = logits.shape
        flat = target_probs(logits.reshape(batch * steps, vocab), [p for p in params for _ in range(steps)])
        return flat.reshape(batch, steps, vocab)
    if len(params) != logits.shape[0]:
        raise ValueError(f"one SamplingParams per row: got {len(params)} for {logits.shape[0]} rows")
    logits = logits.float()
    if not any(p.greedy for p in params):
        return _filtered_softmax(logits, params)
    probs = torch.empty_like(logits)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if greedy.any():
        rows = greedy.nonzero().squeeze(1)
        probs[rows] = _one_hot_argmax(logits[rows])
    if not greedy.all():
        rows = (~greedy).nonzero().squeeze(1)
        probs[rows] = _filtered_softmax(logits[rows], [params[i] for i in rows.tolist()])
    return probs


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Next token per row from logits (B, V) -> (B,) int64."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    return draw(target_probs(logits, params), generators)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of probs (B, V) by inverse CDF, each row with its own generator.

    Zero-probability tokens are never drawn: a searchsorted hit needs cdf[i] > u > cdf[i-1].
    """
    uniforms = torch.stack([torch.rand((), generator=g, device=g.device, dtype=torch.float64) for g in generators]).to(
        probs.device
    )
    cdf = probs.double().cumsum(dim=-1)
    # Scale by the row total: float rounding can leave it a hair under 1.
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # Rounding could still land past the end; fall back to the last token p allows, never a zero one.
    # (A hit inside the vocabulary is always an allowed token, so only those rows need the scan.)
    past = tokens >= probs.shape[-1]
    if past.any():
        tokens = torch.where(past, (probs > 0).cumsum(dim=-1).argmax(dim=-1), tokens)
    return tokens


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(logits)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _filtered_softmax(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """softmax(logits / T) restricted to each row's top-k and top-p set, renormalised."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=logits.device).unsqueeze(1)
    ranked_few = all(p.top_k for p in params)
    if ranked_few:
        # Only the top_k best can survive: rank those few on the raw logits (scaling keeps their
        # order) and scale only them, instead of sorting or scaling the whole vocabulary.
        best, order = logits.topk(min(int(top_k.max()), vocab), dim=-1)
        sorted_logits = _scaled(best, best[:, :1], temperature)
    else:
        scaled = _scaled(logits, logits.max(dim=-1, keepdim=True).values, temperature)
        if all(p.top_k == 0 and p.top_p == 1.0 for p in params):
            return torch.softmax(scaled, dim=-1)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=torch.float64).unsqueeze(1)
    ranks = torch.arange(sorted_logits.shape[-1], device=logits.device).unsqueeze(0)
    removed = ranks >= top_k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(removed, float("-inf")), dim=-1).double()
    # Drop a token once the mass strictly before it already reaches top_p; the first always stays.
    # Rows with top_p = 1 skip this: rounding can bring their running mass to 1 before the tail.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    removed |= (mass_before >= top_p) & (top_p < 1.0)
    removed[:, 0] = False
    if ranked_few:  # every kept token is among them
        kept = torch.softmax(sorted_logits.masked_fill(removed, float("-inf")), dim=-1)
        return torch.zeros_like(logits).scatter_(-1, order, kept)
    mask = torch.ones_like(scaled, dtype=torch.bool).scatter_(-1, order, removed)
    return torch.softmax(scaled.masked_fill(mask, float("-inf")), dim=-1)


def _scaled(logits: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(logits − top) / T. Shift by the row's top logit first: it stays 0, so a tiny temperature
    gives -inf elsewhere (the greedy limit) instead of inf − inf = NaN."""
    return (logits - top) / temperature
