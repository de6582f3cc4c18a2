"""Drafters with trained weights, behind the same interface as prompt lookup and draft models.

- `EagleDrafter`: autoregressive over features. It keeps its own one-layer KV cache of
  (target feature, next token) pairs; after each verification the pairs it drafted on its own
  predicted features are dropped and the target's true features of the accepted tokens fed.
- `MedusaDrafter`: head j reads the target's newest verified feature and proposes the token j+1
  places ahead; no state but that feature per sequence.
- `adapter_exit_model` (the early-exit adapter): the target's first L layers, the trained
  adapter, the final norm and a draft-vocabulary LM head, as a causal LM that `ModelDrafter`
  drives (weights shared with the target, its own cache of those L layers).

The `build_*` functions are what the registry (`policies.drafters`) names for the trained kinds.

All three draw from logits that are -inf outside their draft vocabulary, so q is exact there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from policies.drafters import DrafterConfig

from ..errors import ModelLoadError
from ..kv import UNBOUNDED_TOKENS, PagedCache
from ..models import LoadedModel, resolve_dtype
from .drafters import (
    Drafter,
    DraftJudge,
    DraftRow,
    ModelDrafter,
    Proposal,
    draft_autoregressively,
    draw_drafts,
    early_exit_model,
    named,
)
from .trained import AdaptedNorm, EagleNet, ExitAdapter, MedusaNet, TrainedDrafter, load_drafter, resolve_weights


@dataclass
class _EagleSequence:
    seq: int  # in the head's own cache
    unfed: list[torch.Tensor] = field(default_factory=list)  # true features not yet in the cache
    fed: int = 0  # true (feature, token) pairs in the cache


class EagleDrafter(Drafter):
    def __init__(self, trained: TrainedDrafter):
        assert isinstance(trained.net, EagleNet)
        self.trained, self.net = trained, trained.net
        self.feature_layers = tuple(trained.card.layers)
        # Unbounded here: the head caches one pair per verified token, which the target's cache bounds.
        self.cache = PagedCache(self.net, max_tokens=UNBOUNDED_TOKENS)
        self.sequences: dict[int, _EagleSequence] = {}

    def fresh(self) -> Drafter:
        return self._named_as_me(EagleDrafter(self.trained))

    def observe_target(self, rows: Sequence[DraftRow], features: Sequence[torch.Tensor]) -> None:
        for row, f in zip(rows, features, strict=True):
            self._state(row.key).unfed.append(f)

    def release(self, key: int) -> None:
        state = self.sequences.pop(key, None)
        if state is not None:
            self.cache.remove(state.seq)

    def backlog(self, row: DraftRow) -> int:
        state = self.sequences.get(row.key)
        return row.length if state is None else row.length - 1 - state.fed

    def _state(self, key: int) -> _EagleSequence:
        if key not in self.sequences:
            self.sequences[key] = _EagleSequence(self.cache.add())
        return self.sequences[key]

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int], judge: DraftJudge | None = None) -> Proposal:
        if max(ks, default=0) == 0:
            return Proposal([[] for _ in rows])
        states = [self._state(row.key) for row in rows]
        for state in states:  # pairs drafted on predicted features last time give way to true ones
            self.cache.truncate(state.seq, state.fed)
        seqs = [s.seq for s in states]
        blocks, features = self._true_pairs(rows, states)
        out = self.cache.forward(seqs, blocks, keep="last", features=features)
        last = [out.hidden]  # each drafted token is paired with the feature predicted before it

        def feed(blocks: list[list[int]]) -> torch.Tensor:
            out = self.cache.forward(seqs, blocks, keep="last", features=last[0].unsqueeze(1))
            last[0] = out.hidden
            return out.logits

        return draft_autoregressively(out.logits, rows, ks, feed, judge)

    def _true_pairs(
        self, rows: Sequence[DraftRow], states: Sequence[_EagleSequence]
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Pair i is (feature of context token i, context token i + 1): every verified feature not
        yet fed, with the tokens that follow them, right-padded into one block."""
        blocks, feats = [], []
        for row, state in zip(rows, states, strict=True):
            pending = torch.cat(state.unfed) if state.unfed else None
            count = 0 if pending is None else pending.shape[0]
            assert state.fed + count == row.length - 1, "the engine reports every verified token's feature"
            blocks.append(row.context(state.fed + 1, row.length))
            feats.append(pending)
            state.fed += count
            state.unfed = []
        width = max(max(len(b) for b in blocks), 1)
        size = self.net.config.hidden_size * len(self.feature_layers)
        padded = torch.zeros((len(rows), width, size), dtype=self.net.fc.weight.dtype, device=self.cache.device)
        for b, f in enumerate(feats):
            if f is not None:
                padded[b, : f.shape[0]] = f.to(padded.dtype)
        return blocks, padded


class MedusaDrafter(Drafter):
    def __init__(self, trained: TrainedDrafter):
        assert isinstance(trained.net, MedusaNet)
        self.trained, self.net, self.head = trained, trained.net, trained.head
        self.feature_layers = tuple(trained.card.layers)
        self.max_draft = len(self.net.heads)
        self.latest: dict[int, torch.Tensor] = {}  # per sequence: the newest verified token's feature

    def fresh(self) -> Drafter:
        return self._named_as_me(MedusaDrafter(self.trained))

    def observe_target(self, rows: Sequence[DraftRow], features: Sequence[torch.Tensor]) -> None:
        for row, f in zip(rows, features, strict=True):
            if len(f):
                self.latest[row.key] = f[-1]

    def release(self, key: int) -> None:
        self.latest.pop(key, None)

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int], judge: DraftJudge | None = None) -> Proposal:
        """Every head in one pass (nothing to save by stopping early: `judge` is not asked)."""
        steps = min(max(ks), len(self.net.heads))
        if steps == 0:
            return Proposal([[] for _ in rows])
        assert all(row.key in self.latest for row in rows), "the engine reports the prompt's features before drafting"
        features = torch.stack([self.latest[row.key] for row in rows])
        logits = self.head(self.net(features)[:, :steps])  # (B, steps, V)
        tokens, dists, features = [], [], []
        for j in range(steps):
            token, q, described = draw_drafts(logits[:, j], rows, [j < k for k in ks], j)
            tokens.append(token)
            dists.append(q)
            features.append(described)
        drafted = torch.stack(tokens, dim=1).tolist()
        q = None if dists[0] is None else torch.stack(dists, dim=1)
        described = np.stack(features, axis=1)
        lengths = [min(k, steps) for k in ks]
        return Proposal(
            [drafted[b][:n] for b, n in enumerate(lengths)], q, [described[b, :n] for b, n in enumerate(lengths)]
        )


def adapter_exit_model(target: PreTrainedModel, trained: TrainedDrafter) -> PreTrainedModel:
    """The target's first L layers → adapter → final norm → draft-vocabulary head."""
    assert isinstance(trained.net, ExitAdapter)
    shallow = early_exit_model(target, trained.card.layers[0])
    shallow.model.norm = AdaptedNorm(trained.net, target.model.norm)
    shallow.lm_head = trained.head
    return shallow


def build_eagle(config: DrafterConfig, target: LoadedModel) -> Drafter:
    return named(EagleDrafter(_load(config, target, _heads_dtype(config, target))), config)


def build_medusa(config: DrafterConfig, target: LoadedModel) -> Drafter:
    return named(MedusaDrafter(_load(config, target, _heads_dtype(config, target))), config)


def build_adapter(config: DrafterConfig, target: LoadedModel) -> Drafter:
    """The adapter runs in the target's dtype: it sits between the target's own layers (float32
    over a quantized target, whose layers take and return float32)."""
    dtype = target.info.dtype if target.info.dtype in ("float32", "bfloat16") else "float32"
    trained = _load(config, target, dtype)
    return named(ModelDrafter(adapter_exit_model(target.model, trained), target.model.config.vocab_size), config)


def _heads_dtype(config: DrafterConfig, target: LoadedModel) -> str:
    return config.draft_dtype_under(target.info.dtype) or "bfloat16"  # None is for draft models only


def _load(config: DrafterConfig, target: LoadedModel, dtype: str) -> TrainedDrafter:
    """EAGLE and Medusa run in `draft_dtype` (their own small weights)."""
    if dtype not in ("float32", "bfloat16"):
        raise ModelLoadError(
            f"{config.kind} heads run in float32 or bfloat16, not {dtype}: weight-only draft dtypes are for the "
            "model drafter (--draft-dtype float32 or bfloat16 here)"
        )
    path = resolve_weights(config.weights, config.kind, target.info.name)
    return load_drafter(path, target.model, target.tokenizer, resolve_dtype(dtype))
