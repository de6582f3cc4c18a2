"""Drafters: strategies that propose the next k tokens of each sequence in a batch.

The step loop calls `propose`, `observe`, `observe_target` (for drafters with `feature_layers`),
`backlog`, `release` and `fresh`; it never looks inside.
A proposal carries the tokens, for drafters that sample the distribution q each token was drawn
from (None means deterministic: q is one-hot at the token), and per drafted position the numbers
its acceptance is predicted from (`acceptance_features`; see `backends.speculative.acceptance`).
A drafter that drafts step by step asks a `DraftJudge` after each step whether a row should draft
on, so a proposal whose next token would not pay for itself stops there.

The `build_*` functions are what the registry (`policies.drafters`) names for the untrained kinds.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from policies.drafters import DrafterConfig, drafter_name
from policies.quantization import WEIGHT_ONLY

from ..errors import ModelLoadError
from ..kv import UNBOUNDED_TOKENS, BlockStructure, PagedCache, check_full_attention
from ..models import LoadedModel, load_model
from ..sampling import SamplingParams, draw, target_probs
from .acceptance import CONFIDENCE_FEATURES, NGRAM_FEATURES, confidence_features

# (steps drawn so far, each row's features so far: (steps, f)) -> per row, whether to draw another.
DraftJudge = Callable[[int, list[np.ndarray]], list[bool]]


@dataclass
class DraftRow:
    """What a drafter may read about one sequence: prompt, tokens so far, how it samples. `key`
    names the sequence for as long as it runs: drafters keep their per-sequence state under it."""

    key: int
    prompt_ids: list[int]
    token_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def context(self, start: int = 0, stop: int | None = None) -> list[int]:
        """Tokens start..stop of prompt + output, copying only that slice."""
        split, stop = len(self.prompt_ids), self.length if stop is None else min(stop, self.length)
        if start >= split:
            return self.token_ids[start - split : stop - split]
        if stop <= split:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.token_ids[: stop - split]


@dataclass(frozen=True)
class StructuredDraft:
    """A proposal that is not one chain: several deterministic candidate continuations of the
    row's newest token in one block, beside positions the drafter runs for itself (lookahead's
    Jacobi window). Block index 0 is the newest token; the step loop verifies the candidates with
    the multi-candidate rule and keeps the accepted branch's keys and values."""

    tokens: list[int]
    structure: BlockStructure
    candidates: list[list[int]]
    branches: list[list[int]]  # block indices of each candidate's tokens, in order


@dataclass
class Proposal:
    tokens: list[list[int]]  # per row, at most the k asked for (possibly none)
    q: torch.Tensor | None = None  # (B, max k, V): q[b, j] is what tokens[b][j] was drawn from
    # Per row, (len(tokens[b]), f): what each drafted position's acceptance is predicted from,
    # computed before its token was drawn. None: the drafter reports none.
    features: list[np.ndarray] | None = None
    # Per row, its structured block (then tokens[b] is its longest candidate, for the books).
    structured: list[StructuredDraft | None] | None = None


class Drafter(ABC):
    """One drafter serves every sequence of a step loop: sequences join and leave at any step, so
    per-sequence state lives under `DraftRow.key`, is created the first time a key is seen (a
    drafter catches up on the context it has not read yet) and dropped by `release`."""

    name: str = "drafter"  # the registry's name for it (`policies.drafters.drafter_name`), set by its builder
    # Hidden-state indices of the target (0 = embeddings, last = post-norm) this drafter reads;
    # when non-empty the engine calls `observe_target` after every target pass over its rows.
    feature_layers: tuple[int, ...] = ()
    max_draft: int | None = None  # the most tokens one proposal can hold (None: no limit)
    acceptance_features: tuple[str, ...] = CONFIDENCE_FEATURES  # what Proposal.features holds
    free: bool = False  # drafting costs next to nothing (no model runs): always worth asking
    # Positions of this drafter's widest structured block (0: it drafts chains, k + 1 wide).
    widest_block: int = 0
    # It runs the target's own layers (early exit): only an engine running those layers serves it.
    reads_target_layers: bool = False

    @abstractmethod
    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int], judge: DraftJudge | None = None) -> Proposal:
        """Up to ks[b] ≥ 1 tokens continuing row b. Draws randomness only from rows[b].generator,
        and only for rows that sample. A drafter drafting step by step may stop a row early where
        `judge` says so."""

    def observe(self, rows: Sequence[DraftRow], accepted: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """How many of the last proposal's tokens each of its rows accepted (roll back the rest)."""

    def plan_block(self, row: DraftRow, cap: int, pass_s: Sequence[float]) -> int:
        """k = auto for a drafter of structured blocks: the depth this row's block runs this step
        (0: none), given the most it may (cap ≥ 1) and the measured seconds of a pass per width
        (pass_s[w − 1], up to widest_block). By default its whole block, every step."""
        return cap

    def observe_block(self, rows: Sequence[DraftRow], argmax: Sequence[torch.Tensor]) -> None:  # noqa: B027
        """Per row that verified a structured block this step, the target's argmax at every
        position of that block (what lookahead's window learns from), before any token of it is
        appended."""

    def backlog(self, row: DraftRow) -> int:
        """Tokens of the row's context this drafter would have to read before drafting (a row
        that just joined, or that went without drafts for a while): what drafting now costs extra."""
        return 0

    def release(self, key: int) -> None:  # noqa: B027 - optional hook
        """The sequence left: forget its state."""

    def observe_target(self, rows: Sequence[DraftRow], features: Sequence[torch.Tensor]) -> None:  # noqa: B027
        """Per row, the target's hidden states (`feature_layers` concatenated) of the tokens that
        just became verified context, in order: after a prompt chunk its tokens, after each step
        the pending token and the accepted drafts. The row's newest token has none yet."""

    @abstractmethod
    def fresh(self) -> Drafter:
        """The same drafter (its name included) with no per-sequence state, sharing any weights:
        one per engine."""

    def _named_as_me(self, drafter: Drafter) -> Drafter:
        drafter.name = self.name
        return drafter


@dataclass
class _NgramIndex:
    """Latest end offset of every n-gram seen so far in one sequence, for each n, and how often each
    token followed it."""

    grams: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    followers: dict[int, dict[tuple[int, ...], dict[int, int]]] = field(default_factory=dict)
    indexed_to: int = 0  # n-grams ending at offsets < this are indexed


class NgramDrafter(Drafter):
    """Prompt lookup: find the longest suffix n-gram (n from max_n down to min_n) that occurred
    earlier in the prompt or the output and propose what followed its latest occurrence.
    Deterministic and nearly free; strong when the answer copies its input. Each proposal is
    described by its match (NGRAM_FEATURES): the length of the whole matching stretch (up to
    MATCH_LIMIT — long when the answer has been copying for a while), how often the suffix occurred
    and how often it was followed by the proposed token, how far back the copied occurrence is."""

    acceptance_features = NGRAM_FEATURES
    free = True
    MATCH_LIMIT = 64

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got min_n={min_n}, max_n={max_n})")
        self.max_n, self.min_n = max_n, min_n
        self.indexes: dict[int, _NgramIndex] = {}

    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int], judge: DraftJudge | None = None) -> Proposal:
        found = [self._lookup(row, self._index(row.key), k) for row, k in zip(rows, ks, strict=True)]
        return Proposal([tokens for tokens, _ in found], features=[f for _, f in found])

    def release(self, key: int) -> None:
        self.indexes.pop(key, None)

    def fresh(self) -> Drafter:
        return self._named_as_me(NgramDrafter(self.max_n, self.min_n))

    def _index(self, key: int) -> _NgramIndex:
        if key not in self.indexes:
            ns = range(self.min_n, self.max_n + 1)
            self.indexes[key] = _NgramIndex({n: {} for n in ns}, {n: {} for n in ns})
        return self.indexes[key]

    def _lookup(self, row: DraftRow, index: _NgramIndex, k: int) -> tuple[list[int], np.ndarray]:
        none = np.zeros((0, len(NGRAM_FEATURES)))
        if k <= 0:
            return [], none
        context = row.context(max(0, index.indexed_to - self.max_n))
        offset = row.length - len(context)
        # Index n-grams ending before the last token: the suffix itself must not match itself.
        for end in range(max(index.indexed_to, 1), row.length):
            following = context[end - offset]
            for n, grams in index.grams.items():
                if end - n >= 0 and end - n >= offset:
                    gram = tuple(context[end - n - offset : end - offset])
                    grams[gram] = end
                    seen = index.followers[n].setdefault(gram, {})
                    seen[following] = seen.get(following, 0) + 1
        index.indexed_to = max(index.indexed_to, row.length)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n > row.length:
                continue
            suffix = tuple(row.context(row.length - n))
            end = index.grams[n].get(suffix)
            if end is not None:
                tokens = row.context(end, end + k)
                return tokens, self._features(row, end, index.followers[n][suffix], tokens)
        return [], none

    def _features(self, row: DraftRow, end: int, followers: dict[int, int], tokens: list[int]) -> np.ndarray:
        """NGRAM_FEATURES of each proposed position (the match's, and the position)."""
        reach = min(self.MATCH_LIMIT, end)
        before, recent = row.context(end - reach, end), row.context(row.length - reach)
        match = 0
        while match < reach and before[-1 - match] == recent[-1 - match]:
            match += 1
        occurrences = sum(followers.values())
        agreement = followers.get(tokens[0], 0) / occurrences if occurrences else 0.0
        shared = [np.log1p(match), np.log1p(occurrences), agreement, np.log1p(row.length - end)]
        return np.array([[*shared, float(j)] for j in range(len(tokens))])


@dataclass
class _DraftSequence:
    """A model drafter's view of one sequence: its id in the drafter's cache, the tokens whose keys
    sit there, and how many of them are known to equal the sequence's context."""

    seq: int
    cached: list[int] = field(default_factory=list)
    synced: int = 0


class ModelDrafter(Drafter):
    """A causal LM sharing the target's vocabulary drafts autoregressively with its own KV cache,
    rolled back to the accepted prefix after each verification. A sequence it has not seen (or
    not drafted for in a while) first catches up on the context it is missing."""

    def __init__(self, model: PreTrainedModel, target_vocab: int):
        vocab = model.config.vocab_size  # a draft-vocabulary head still scores the full vocabulary
        if vocab != target_vocab:
            raise ModelLoadError(
                f"the draft model's vocabulary ({vocab} tokens) differs from the target's ({target_vocab}): "
                "a drafter must share the target's tokenizer"
            )
        self.model = model
        check_full_attention(model)
        self.cache: PagedCache | None = None
        self.sequences: dict[int, _DraftSequence] = {}

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], ks: Sequence[int], judge: DraftJudge | None = None) -> Proposal:
        if max(ks, default=0) == 0:
            return Proposal([[] for _ in rows])
        states = [self._state(row.key) for row in rows]
        pending = [self._rollback_to_context(row, state) for row, state in zip(rows, states, strict=True)]
        cache, seqs = self._cache(), [s.seq for s in states]
        proposal = draft_autoregressively(
            cache.last_logits(seqs, pending), rows, ks, lambda blocks: cache.last_logits(seqs, blocks), judge
        )
        for state, row, block, tokens in zip(states, rows, pending, proposal.tokens, strict=True):
            # Every drafted token but the last went through the cache (the last was only drawn).
            state.cached += block + tokens[: max(len(tokens) - 1, 0)]
            state.synced = row.length
        return proposal

    def fresh(self) -> Drafter:
        return self._named_as_me(ModelDrafter(self.model, self.model.config.vocab_size))

    def observe(self, rows: Sequence[DraftRow], accepted: Sequence[int]) -> None:
        """Roll the cache back to the context plus the accepted drafts."""
        for row, n in zip(rows, accepted, strict=True):
            state = self.sequences[row.key]
            keep = min(len(state.cached), state.synced + n)
            del state.cached[keep:]
            self._cache().truncate(state.seq, keep)

    def release(self, key: int) -> None:
        state = self.sequences.pop(key, None)
        if state is not None:
            self._cache().remove(state.seq)

    def backlog(self, row: DraftRow) -> int:
        state = self.sequences.get(row.key)
        return row.length if state is None else row.length - min(state.synced, len(state.cached))

    def _cache(self) -> PagedCache:
        if self.cache is None:
            # Unbounded here: every sequence's draft cache is at most its context plus a draft, so
            # the target's cache, which admits only what fits, bounds this one too.
            self.cache = PagedCache(self.model, max_tokens=UNBOUNDED_TOKENS)
        return self.cache

    def _state(self, key: int) -> _DraftSequence:
        if key not in self.sequences:
            self.sequences[key] = _DraftSequence(self._cache().add())
        return self.sequences[key]

    def _rollback_to_context(self, row: DraftRow, state: _DraftSequence) -> list[int]:
        """Drop cached tokens past the longest prefix the sequence shares with its context; return
        what it still has to feed (never empty: the last token's logits start the draft)."""
        cached = state.cached
        base = min(state.synced, len(cached))
        tail = row.context(base)
        same = 0
        while base + same < len(cached) and same < len(tail) and cached[base + same] == tail[same]:
            same += 1
        keep = min(base + same, row.length - 1)
        if keep < len(cached):
            del cached[keep:]
            self._cache().truncate(state.seq, keep)
        return row.context(keep)


def draft_autoregressively(
    logits: torch.Tensor,
    rows: Sequence[DraftRow],
    ks: Sequence[int],
    feed: Callable[[list[list[int]]], torch.Tensor],
    judge: DraftJudge | None = None,
) -> Proposal:
    """Draw up to ks[b] tokens per row, one step at a time: `logits` (B, V) give the first;
    `feed(blocks)` appends each row's drafted token (an empty block for rows already done, a hole
    rather than a position) and returns the next logits. After each step `judge` (if any) sees
    every row's features so far and may stop rows; drafting ends when no row goes on."""
    ks = list(ks)
    steps = max(ks)
    tokens, dists, features = [], [], []
    for step in range(steps):
        token, q, described = draw_drafts(logits, rows, [step < k for k in ks], step)
        tokens.append(token)
        dists.append(q)
        features.append(described)
        if step + 1 >= max(ks):
            break
        if judge is not None:
            so_far = np.stack(features, axis=1)
            going = judge(step + 1, [so_far[b, : min(k, step + 1)] for b, k in enumerate(ks)])
            ks = [k if keep else min(k, step + 1) for k, keep in zip(ks, going, strict=True)]
            if step + 1 >= max(ks):
                break
        logits = feed([[t] if step + 1 < k else [] for t, k in zip(token.tolist(), ks, strict=True)])
    drafted = torch.stack(tokens, dim=1).tolist()
    q = None if dists[0] is None else torch.stack(dists, dim=1)
    described = np.stack(features, axis=1)
    return Proposal([drafted[b][:k] for b, k in enumerate(ks)], q, [described[b, :k] for b, k in enumerate(ks)])


def draw_drafts(
    logits: torch.Tensor, rows: Sequence[DraftRow], drawing: Sequence[bool], position: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, np.ndarray]:
    """Next draft token per row from (B, V) logits, q (None when every row is greedy), and each
    row's CONFIDENCE_FEATURES at this `position`, read from the distribution before any draw.
    Greedy rows, and rows whose drafts are already complete, take the argmax and draw no random
    number; sampling rows draw from q = the target's sampling transform of the draft logits."""
    tokens = logits.argmax(dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)
    sampled = [b for b, row in enumerate(rows) if not row.sampling.greedy]
    if not sampled:
        return tokens, None, _described(probs, position)
    q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    q[sampled] = target_probs(logits[sampled], [rows[b].sampling for b in sampled])
    probs[sampled] = q[sampled]  # a sampling row is described by what it draws from
    described = _described(probs, position)
    drawing_rows = [b for b in sampled if drawing[b]]
    if drawing_rows:
        tokens[drawing_rows] = draw(q[drawing_rows], [rows[b].generator for b in drawing_rows])
    return tokens, q, described


def _described(probs: torch.Tensor, position: int) -> np.ndarray:
    """CONFIDENCE_FEATURES of (B, V) distributions (reduced on their device; (B, 3) comes back)."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)
    return confidence_features(probs.max(dim=-1).values.cpu().numpy(), entropy.cpu().numpy(), position)


def early_exit_model(target: PreTrainedModel, layers: int) -> PreTrainedModel:
    """The target's first `layers` decoder layers + its final norm + LM head, as a model object that
    shares the target's weights (no copy): self-speculation without extra weight memory."""
    decoder = getattr(target, "model", None)
    total = len(getattr(decoder, "layers", []))
    if not total:
        raise ModelLoadError(f"early exit needs a decoder with .model.layers; {type(target).__name__} has none")
    if not 1 <= layers < total:
        raise ModelLoadError(
            f"exit layer must be between 1 and {total - 1} for this {total}-layer target (got {layers})"
        )
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    shallow = _share_modules(target)
    shallow.config = config
    shallow.model = _share_modules(decoder)
    shallow.model.config = config
    shallow.model.layers = torch.nn.ModuleList(list(decoder.layers[:layers]))
    return shallow


def _share_modules(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object whose children, parameters and buffers are the original's own objects;
    replacing a child on the copy leaves the original untouched."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def named(drafter: Drafter, config: DrafterConfig, detail: str = "") -> Drafter:
    drafter.name = drafter_name(config, detail)
    return drafter


def build_ngram(config: DrafterConfig, target: LoadedModel) -> Drafter:
    return named(NgramDrafter(max_n=config.ngram_max, min_n=config.ngram_min), config)


def build_early_exit(config: DrafterConfig, target: LoadedModel) -> Drafter:
    drafter = named(ModelDrafter(early_exit_model(target.model, config.exit_layer), _vocab(target)), config)
    drafter.reads_target_layers = True
    return drafter


def build_model_drafter(config: DrafterConfig, target: LoadedModel) -> Drafter:
    draft = _load_draft(config, target)
    if draft.info.name == target.info.name and draft.info.dtype == target.info.dtype:
        raise ModelLoadError(
            "the draft model is the target itself in the same dtype, which can never be faster: "
            "pick a smaller model with the same tokenizer, or another draft_dtype (auto: bfloat16 under a float32 "
            "target, weight-only quantized under a bfloat16 one)"
        )
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ModelLoadError(
            f"the draft model {config.draft_model!r} has a different tokenizer from the target: "
            "a drafter must share the target's vocabulary"
        )
    return named(ModelDrafter(draft.model, _vocab(target)), config, f"{draft.info.name}@{draft.info.dtype}")


def _load_draft(config: DrafterConfig, target: LoadedModel) -> LoadedModel:
    """The draft model in its dtype; a weight-only method loads float32 weights and quantizes them
    (the same kernels as the quantized backend, so a draft step reads a quarter or an eighth of the
    bytes, and the drafts stay close to the float model's own)."""
    dtype = config.draft_dtype_under(target.info.dtype)
    if dtype is not None and dtype not in WEIGHT_ONLY:
        return load_model(config.draft_model, dtype=dtype, device=target.info.device)
    from ..quantized import quantize  # here: the quantized module imports the engines

    # None: the method the weights fit (int4 on a 4-bit grid, else int8), what "auto" quantizes to.
    return quantize(load_model(config.draft_model, device=target.info.device), method=dtype or "auto")


def _vocab(target: LoadedModel) -> int:
    return target.model.get_output_embeddings().weight.shape[0]
