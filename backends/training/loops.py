"""What each kind of drafter learns from the self-distilled sequences, as batches and losses.

Labels are the target's own next tokens: the answers were generated greedily by the target in
the dtype it serves in, so answer token t+1 is the target's argmax after token t. Features are
the target's hidden states from one teacher-forced pass. Losses cover the answer positions (where
drafting happens); the prompt is context only.

- EAGLE, at pair i = (f_i, x_{i+1}): regress f_{i+1} (smooth L1) and classify x_{i+2} through the
  frozen LM head (weight 0.1, as in EAGLE). A second, unrolled pass feeds the first pass's
  predicted features in place of the true ones, the situation of draft positions 2+ (there the
  earlier keys are predicted too: an approximation of EAGLE-3's training-time test).
- Medusa, head j at position i: classify x_{i+2+j} from f_i.
- Early-exit adapter, at position i: classify x_{i+1} from layer L's state through the adapter,
  the final norm and the LM head.

Each task class is what the drafter registry (`policies.drafters`) names as its kind's `task`:
it builds the untrained network, says which target layers it reads and what the card records.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..errors import TrainingError
from ..packing import packing_available
from ..speculative.trained import DraftVocab, EagleNet, ExitAdapter, MedusaNet

if TYPE_CHECKING:
    from ..models import LoadedModel
    from .train import TrainConfig

IGNORE = -100
EAGLE_CLASSIFY_WEIGHT = 0.1
UNROLL_WEIGHT = 0.5


@dataclass
class Sequences:
    """Self-distilled sequences with their features, ready for training."""

    ids: list[torch.Tensor]  # (T,) prompt + answer
    prompt_lengths: list[int]
    features: list[torch.Tensor]  # (T, F) bfloat16: the layers the kind reads, concatenated
    labels: list[torch.Tensor]  # (T,) draft-vocabulary index of token t, IGNORE outside it

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class Metrics:
    loss: float
    top1: list[float]  # agreement with the target's token, per draft position
    tokens: int


class Task:
    """One kind's batches, loss and held-out evaluation."""

    positions: int = 1  # draft positions the evaluation reports
    sequence_level = False  # batches of whole sequences (sized in tokens) or of single positions
    noise = 0.0  # feature noise while training, absolute

    def __init__(self, net: torch.nn.Module, head: DraftVocab):
        self.net, self.head = net, head

    @classmethod
    def create(cls, config: TrainConfig, loaded: LoadedModel, head: DraftVocab, rms: float) -> Task:
        """The untrained network of this kind in its task; `rms` is the features' scale."""
        raise NotImplementedError

    @classmethod
    def feature_layers(cls, config: TrainConfig, layers: int) -> list[int]:
        """Target hidden-state indices the kind reads: by default the last, post-norm (the LM head
        of it gives the logits)."""
        return [layers]

    @classmethod
    def card_fields(cls, config: TrainConfig) -> dict[str, int]:
        """The network's sizes the card records (what `from_card` rebuilds it from)."""
        return {}

    def batches(self, data: Sequences, batch_tokens: int, rng: random.Random) -> Iterator[dict[str, torch.Tensor]]:
        raise NotImplementedError

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The training loss and, per draft position, (predicted, label) index pairs."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, data: Sequences, batch_tokens: int) -> Metrics:
        self.net.eval()
        total, count = 0.0, 0
        right = [0] * self.positions
        seen = [0] * self.positions
        for batch in self.batches(data, batch_tokens, random.Random(0)):
            with autocast():
                loss, pairs = self.loss(batch)
            total += float(loss)
            count += 1
            for j, (pred, label) in enumerate(pairs):
                valid = label != IGNORE
                right[j] += int((pred[valid] == label[valid]).sum())
                seen[j] += int(valid.sum())
        self.net.train()
        return Metrics(total / max(count, 1), [r / max(s, 1) for r, s in zip(right, seen, strict=True)], seen[0])


def autocast() -> torch.autocast:
    """bfloat16 matmuls on CPU (AMX where present) with float32 master weights; float32 where oneDNN
    has no bfloat16 kernels for this CPU (AVX2 only), which would emulate each product many times slower
    (the same test the packed kernels make: one place decides what oneDNN runs here)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=packing_available(torch.bfloat16))


def _pad(rows: Sequence[torch.Tensor], value: float | int) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=value)


def _sequence_batches(data: Sequences, batch_tokens: int, rng: random.Random) -> Iterator[list[int]]:
    """Groups of sequence indices of similar length, at most `batch_tokens` padded tokens each."""
    order = sorted(range(len(data)), key=lambda i: len(data.ids[i]) + rng.random())
    groups, current, longest = [], [], 0
    for i in order:
        longest_if = max(longest, len(data.ids[i]))
        if current and longest_if * (len(current) + 1) > batch_tokens:
            groups.append(current)
            current, longest_if = [], len(data.ids[i])
        current.append(i)
        longest = longest_if
    if current:
        groups.append(current)
    rng.shuffle(groups)
    yield from groups


def _answer_mask(length: int, prompt: int, first: int) -> torch.Tensor:
    """True at positions >= prompt + first (offsets into a shifted sequence)."""
    return torch.arange(length) >= prompt + first


class EagleTask(Task):
    positions = 2
    sequence_level = True

    @classmethod
    def create(cls, config: TrainConfig, loaded: LoadedModel, head: DraftVocab, rms: float) -> Task:
        model = loaded.model
        net = EagleNet(model.config, config.eagle_width)
        net.attach(model.get_input_embeddings(), head)
        task = cls(net, head)
        task.noise = config.noise * rms
        return task

    @classmethod
    def card_fields(cls, config: TrainConfig) -> dict[str, int]:
        return {"width": config.eagle_width}

    def batches(self, data: Sequences, batch_tokens: int, rng: random.Random) -> Iterator[dict[str, torch.Tensor]]:
        for group in _sequence_batches(data, batch_tokens, rng):
            feats, tokens, targets, labels, mask = [], [], [], [], []
            for i in group:
                ids, f, lab, p = data.ids[i], data.features[i], data.labels[i], data.prompt_lengths[i]
                n = len(ids) - 1  # pairs (f_i, x_{i+1}), i = 0 … T-2
                feats.append(f[:-1])
                tokens.append(ids[1:])
                targets.append(f[1:])
                shifted = torch.cat([lab[2:], torch.full((1,), IGNORE)])  # x_{i+2}; none after the end
                keep = _answer_mask(n, p, -2)  # predictions of answer tokens
                labels.append(torch.where(keep, shifted, IGNORE))
                mask.append(torch.ones(n, dtype=torch.long))
            yield {
                "features": _pad(feats, 0.0).float(),
                "tokens": _pad(tokens, 0),
                "targets": _pad(targets, 0.0).float(),
                "labels": _pad(labels, IGNORE),
                "mask": _pad(mask, 0),
            }

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        net = self.net
        assert isinstance(net, EagleNet)
        features, tokens, mask = batch["features"], batch["tokens"], batch["mask"]
        if self.noise and net.training:
            features = features + (torch.rand_like(features) - 0.5) * 2 * self.noise
        hidden = net.hidden(tokens, features, attention_mask=mask)
        loss1, pred1 = self._terms(hidden, batch["targets"], batch["labels"], mask)
        # Unrolled: pair i reads the feature predicted at pair i - 1 instead of the target's (what
        # draft position 2 sees); it still predicts f_{i+1} and x_{i+2}.
        shifted = torch.cat([features[:, :1], hidden[:, :-1].float()], dim=1)
        hidden2 = net.hidden(tokens, shifted, attention_mask=mask)
        labels2 = batch["labels"].clone()
        labels2[:, 0] = IGNORE
        loss2, pred2 = self._terms(hidden2, batch["targets"], labels2, mask)
        return loss1 + UNROLL_WEIGHT * loss2, [(pred1, batch["labels"]), (pred2, labels2)]

    def _terms(
        self, hidden: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        valid = labels != IGNORE
        regress = F.smooth_l1_loss(hidden.float()[valid], targets[valid]) if bool(valid.any()) else hidden.sum() * 0
        logits = self.head.draft_logits(hidden[valid]).float()
        classify = F.cross_entropy(logits, labels[valid]) if bool(valid.any()) else regress * 0
        pred = torch.full_like(labels, IGNORE)
        pred[valid] = logits.argmax(dim=-1)
        return regress + EAGLE_CLASSIFY_WEIGHT * classify, pred


class _TokenTask(Task):
    """Kinds trained on independent positions: batches of (feature row, labels)."""

    def _pairs(self, data: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def batches(self, data: Sequences, batch_tokens: int, rng: random.Random) -> Iterator[dict[str, torch.Tensor]]:
        if not hasattr(data, "_pairs_cache"):
            data._pairs_cache = self._pairs(data)  # type: ignore[attr-defined]
        features, labels = data._pairs_cache  # type: ignore[attr-defined]
        order = torch.randperm(features.shape[0], generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        for start in range(0, len(order), batch_tokens):
            index = order[start : start + batch_tokens]
            yield {"features": features[index].float(), "labels": labels[index]}


class MedusaTask(_TokenTask):
    def __init__(self, net: MedusaNet, head: DraftVocab):
        super().__init__(net, head)
        self.positions = len(net.heads)

    @classmethod
    def create(cls, config: TrainConfig, loaded: LoadedModel, head: DraftVocab, rms: float) -> Task:
        return cls(MedusaNet(loaded.model.config.hidden_size, config.heads), head)

    @classmethod
    def card_fields(cls, config: TrainConfig) -> dict[str, int]:
        return {"heads": config.heads}

    def _pairs(self, data: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
        heads = self.positions
        feats, labels = [], []
        for ids, f, lab, p in zip(data.ids, data.features, data.labels, data.prompt_lengths, strict=True):
            start = max(p - 1, 0)  # f at the last prompt token predicts the first answer token
            rows = torch.arange(start, len(ids) - 1)
            ahead = torch.stack(
                [torch.cat([lab, torch.full((heads + 2,), IGNORE)])[rows + 2 + j] for j in range(heads)], dim=1
            )
            feats.append(f[rows])
            labels.append(ahead)
        return torch.cat(feats), torch.cat(labels)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        states = self.net(batch["features"])  # (N, heads, H)
        logits = self.head.draft_logits(states).float()  # (N, heads, Vd)
        labels = batch["labels"]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        preds = logits.argmax(dim=-1)
        return loss, [(preds[:, j], labels[:, j]) for j in range(self.positions)]


class ExitTask(_TokenTask):
    """Features are (layer L state, final-norm weight applied later): the adapter's input."""

    def __init__(self, net: ExitAdapter, head: DraftVocab, norm: torch.nn.Module):
        super().__init__(net, head)
        self.norm = norm

    @classmethod
    def create(cls, config: TrainConfig, loaded: LoadedModel, head: DraftVocab, rms: float) -> Task:
        model = loaded.model
        return cls(ExitAdapter(model.config.hidden_size, config.adapter_width), head, model.model.norm)

    @classmethod
    def feature_layers(cls, config: TrainConfig, layers: int) -> list[int]:
        if not 1 <= config.exit_layer < layers:
            raise TrainingError(f"exit_layer must be between 1 and {layers - 1} for this {layers}-layer target")
        return [config.exit_layer]

    @classmethod
    def card_fields(cls, config: TrainConfig) -> dict[str, int]:
        return {"width": config.adapter_width}

    def _pairs(self, data: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
        feats, labels = [], []
        for ids, f, lab, p in zip(data.ids, data.features, data.labels, data.prompt_lengths, strict=True):
            rows = torch.arange(max(p - 1, 0), len(ids) - 1)
            feats.append(f[rows])
            labels.append(lab[rows + 1])
        return torch.cat(feats), torch.cat(labels)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        states = self.norm(self.net(batch["features"]))
        logits = self.head.draft_logits(states).float()
        labels = batch["labels"]
        return F.cross_entropy(logits, labels, ignore_index=IGNORE), [(logits.argmax(dim=-1), labels)]
