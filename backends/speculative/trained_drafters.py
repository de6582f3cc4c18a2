"""Drafters with trained weights, behind the same interface as prompt lookup and draft models.

- `EagleDrafter`: autoregressive over features. It keeps its own one-layer KV cache of
  (target feature, next token) pairs; after each verification the pairs it drafted on its own
  predicted features are dropped and the target's true features of the accepted tokens fed.
- `MedusaDrafter`: head j reads the target's newest verified feature and proposes the token j+1
  places ahead; no state but that feature.
- `adapter_exit_model`: the target's first L layers, the trained adapter, the final norm and a
  draft-vocabulary LM head, as a causal LM that `ModelDrafter` drives (weights shared with the
  target, its own cache of those L layers).

All three draw from logits that are -inf outside their draft vocabulary, so q is exact there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from .drafters import (
    Drafter,
    DraftRow,
    ModelDrafter,
    Proposal,
    draft_autoregressively,
    draw_drafts,
    early_exit_model,
)
from .kv import BatchedCache
from .trained import AdaptedNorm, EagleNet, ExitAdapter, MedusaNet, TrainedDrafter


class EagleDrafter(Drafter):
    name = "eagle"

    def __init__(self, trained: TrainedDrafter, pad_id: int):
        assert isinstance(trained.net, EagleNet)
        self.trained, self.net, self.pad_id = trained, trained.net, pad_id
        self.feature_layers = tuple(trained.card.layers)
        self.cache: BatchedCache | None = None
        self.unfed: list[list[torch.Tensor]] = []  # true features not yet in the cache, per row
        self.fed: list[int] = []  # true (feature, token) pairs in the cache, per row

    def fresh(self) -> EagleDrafter:
        return EagleDrafter(self.trained, self.pad_id)

    def start(self, rows: Sequence[DraftRow]) -> None:
        self.cache = BatchedCache(self.net, self.pad_id)
        self.cache.start_empty(len(rows))
        self.unfed = [[] for _ in rows]
        self.fed = [0 for _ in rows]

    def observe_target(self, features: Sequence[torch.Tensor]) -> None:
        for pending, f in zip(self.unfed, features, strict=True):
            pending.append(f)

    def select(self, rows: Sequence[int]) -> None:
        assert self.cache is not None
        self.cache.select(rows)
        self.unfed = [self.unfed[r] for r in rows]
        self.fed = [self.fed[r] for r in rows]

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> Proposal:
        assert self.cache is not None, "start() comes first"
        steps = max(ks)
        if steps == 0:
            return Proposal([[] for _ in rows])
        # Pairs drafted on predicted features last time are replaced by the target's true ones.
        self.cache.truncate(self.fed)
        cache = self.cache
        blocks, features = self._true_pairs(rows)
        logits, hidden = cache.extend_last_outputs(blocks, features=features)
        last = [hidden]  # each drafted token is paired with the feature predicted before it

        def feed(blocks: list[list[int]]) -> torch.Tensor:
            logits, last[0] = cache.extend_last_outputs(blocks, features=last[0].unsqueeze(1))
            return logits

        return draft_autoregressively(logits, rows, ks, feed)

    def _true_pairs(self, rows: Sequence[DraftRow]) -> tuple[list[list[int]], torch.Tensor]:
        """Pair i is (feature of context token i, context token i + 1): every verified feature not
        yet fed, with the tokens that follow them, right-padded into one block."""
        blocks, feats = [], []
        for b, row in enumerate(rows):
            pending = torch.cat(self.unfed[b]) if self.unfed[b] else None
            count = 0 if pending is None else pending.shape[0]
            assert self.fed[b] + count == row.length - 1, "the engine reports every verified token's feature"
            blocks.append(row.context(self.fed[b] + 1, row.length))
            feats.append(pending)
            self.fed[b] += count
            self.unfed[b] = []
        width = max(max(len(b) for b in blocks), 1)
        size = self.net.config.hidden_size * len(self.feature_layers)
        padded = torch.zeros((len(rows), width, size), dtype=self.net.fc.weight.dtype, device=self.cache.device)
        for b, f in enumerate(feats):
            if f is not None:
                padded[b, : f.shape[0]] = f.to(padded.dtype)
        return blocks, padded


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, trained: TrainedDrafter):
        assert isinstance(trained.net, MedusaNet)
        self.trained, self.net, self.head = trained, trained.net, trained.head
        self.feature_layers = tuple(trained.card.layers)
        self.max_draft = len(self.net.heads)
        self.latest: list[torch.Tensor | None] = []

    def fresh(self) -> MedusaDrafter:
        return MedusaDrafter(self.trained)

    def start(self, rows: Sequence[DraftRow]) -> None:
        self.latest = [None for _ in rows]

    def observe_target(self, features: Sequence[torch.Tensor]) -> None:
        self.latest = [f[-1] for f in features]

    def select(self, rows: Sequence[int]) -> None:
        self.latest = [self.latest[r] for r in rows]

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int]) -> Proposal:
        steps = min(max(ks), len(self.net.heads))
        if steps == 0:
            return Proposal([[] for _ in rows])
        features = torch.stack([f for f in self.latest if f is not None])
        assert features.shape[0] == len(rows), "the engine reports the prompt's features before drafting"
        logits = self.head(self.net(features)[:, :steps])  # (B, steps, V)
        tokens, dists = [], []
        for j in range(steps):
            token, q = draw_drafts(logits[:, j], rows, [j < k for k in ks])
            tokens.append(token)
            dists.append(q)
        drafted = torch.stack(tokens, dim=1).tolist()
        q = None if dists[0] is None else torch.stack(dists, dim=1)
        return Proposal([drafted[b][: min(k, steps)] for b, k in enumerate(ks)], q)


def adapter_exit_model(target: PreTrainedModel, trained: TrainedDrafter) -> PreTrainedModel:
    """The target's first L layers → adapter → final norm → draft-vocabulary head."""
    assert isinstance(trained.net, ExitAdapter)
    shallow = early_exit_model(target, trained.card.layers[0])
    shallow.model.norm = AdaptedNorm(trained.net, target.model.norm)
    shallow.lm_head = trained.head
    return shallow


def adapter_drafter(target: PreTrainedModel, trained: TrainedDrafter, pad_id: int) -> ModelDrafter:
    drafter = ModelDrafter(adapter_exit_model(target, trained), pad_id, target.config.vocab_size)
    drafter.name = "early-exit-adapter"
    return drafter
