"""A batched KV cache whose rows hold different numbers of valid tokens.

Speculative steps accept a different number of drafted tokens in every row. Rather than
re-padding the whole cache each step, rejected entries stay in place as *holes*: the attention
mask hides them and every row keeps its own position counter, so a row attends to exactly its
own valid tokens at exactly their positions. Trailing columns no row uses are cropped at once;
when holes pile up the cache is compacted (each row's valid entries gathered to the right).
At batch 1 no hole ever survives: the cache is simply cropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from ..errors import ModelLoadError
from ..plain import left_pad, position_ids

# Compact once holes make up this share of the cache width (and at least this many columns):
# attending over a few holes is cheaper than gathering every layer's keys and values.
COMPACT_SHARE = 0.25
COMPACT_MIN_COLUMNS = 32


class BatchedCache:
    def __init__(self, model: PreTrainedModel, pad_id: int, feature_layers: Sequence[int] = ()):
        """With `feature_layers`, every forward also keeps those hidden states in `features`,
        (B, T, len(layers) · H) over the positions just fed."""
        self.model = model
        self.pad_id = pad_id
        self.feature_layers = tuple(feature_layers)
        self.features: torch.Tensor | None = None
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        if not all(type(layer) is DynamicLayer for layer in self.cache.layers):
            raise ModelLoadError(
                f"speculative decoding needs full-attention layers; {type(model).__name__} uses sliding-window "
                "or linear-attention layers whose state cannot be rolled back: serve it with the plain engine"
            )
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    def start_empty(self, batch: int) -> None:
        """`batch` rows holding nothing yet: the first `extend` fills them (a drafter that feeds
        its own inputs rather than prompts)."""
        self.mask = torch.zeros((batch, 0), dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Fill an empty cache with left-padded prompts; the logits after each prompt, (B, V)."""
        input_ids, mask = left_pad([list(p) for p in prompts], self.pad_id, self.device)
        self.mask, self.lengths = mask, mask.sum(dim=1)
        return self._forward(input_ids, position_ids(mask), logits_to_keep=1).logits[:, -1]

    def extend(self, blocks: Sequence[Sequence[int]], width: int | None = None) -> torch.Tensor:
        """Append one block of tokens per row (rows may differ in length, even be empty); logits
        at every block position, (B, T, V). The block is right-padded to `width` (≥ the longest
        block): padding sits after a row's real tokens, so causal attention keeps it invisible to
        them, and it stays a hole in the cache."""
        input_ids, positions = self._append(blocks, width)
        return self._forward(input_ids, positions, logits_to_keep=input_ids.shape[1]).logits

    def extend_last(self, blocks: Sequence[Sequence[int]], **inputs: torch.Tensor) -> torch.Tensor:
        """Like `extend`, but only the logits after each row's last new token, (B, V): catching up
        on many tokens then costs no LM-head work for positions nobody samples from."""
        return self.extend_last_outputs(blocks, ("logits",), **inputs)[0]

    def extend_last_outputs(
        self, blocks: Sequence[Sequence[int]], names: Sequence[str] = ("logits", "hidden"), **inputs: torch.Tensor
    ) -> list[torch.Tensor]:
        """`extend_last` for models that return more than logits: each named output at each row's
        last new token. `inputs` are extra per-position model inputs laid out like the padded block
        (B, width, …), e.g. the features an EAGLE head reads."""
        counts = [max(len(b), 1) for b in blocks]
        input_ids, positions = self._append(blocks, None)
        wanted = sorted(set(c - 1 for c in counts))
        keep = torch.tensor(wanted, device=self.device)
        out = self._forward(input_ids, positions, logits_to_keep=keep, **inputs)
        rows = torch.arange(len(blocks), device=self.device)
        columns = torch.tensor([wanted.index(c - 1) for c in counts], device=self.device)
        return [getattr(out, name)[rows, columns] for name in names]

    def _append(self, blocks: Sequence[Sequence[int]], width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded input ids and positions for a block; the mask and lengths grow with it."""
        counts = torch.tensor([len(b) for b in blocks], device=self.device)
        width = max(int(counts.max()), 1) if width is None else width
        input_ids = torch.full((len(blocks), width), self.pad_id, dtype=torch.long, device=self.device)
        for row, block in enumerate(blocks):
            input_ids[row, : len(block)] = torch.tensor(list(block), dtype=torch.long)
        columns = torch.arange(width, device=self.device).unsqueeze(0)
        real = columns < counts.unsqueeze(1)
        self.mask = torch.cat([self.mask, real.long()], dim=1)
        # Padding repeats the row's last position: it is a hole anyway, and must never index past
        # the context (learned position tables) or stretch rotary scaling.
        last = (self.lengths + counts - 1).clamp(min=0).unsqueeze(1)
        positions = torch.where(real, self.lengths.unsqueeze(1) + columns, last)
        self.lengths = self.lengths + counts
        return input_ids, positions

    def truncate(self, lengths: torch.Tensor | Sequence[int]) -> None:
        """Keep the first lengths[b] valid tokens of each row; later ones become holes."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.device)
        if bool((lengths > self.lengths).any()):
            raise ValueError("truncate can only shorten rows")
        self.mask = self.mask * (self.mask.cumsum(dim=1) <= lengths.unsqueeze(1))
        self.lengths = lengths
        self._crop_unused_tail()
        self._compact_if_sparse()

    def select(self, rows: Sequence[int]) -> None:
        """Keep only the given rows (finished sequences leave the batch)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask, self.lengths = self.mask[index], self.lengths[index]
        self._crop_unused_tail()
        self._compact_if_sparse()

    def holes(self) -> int:
        """Columns beyond the longest row: what compaction would free."""
        return self.mask.shape[1] - int(self.lengths.max()) if self.batch_size else 0

    def compact(self) -> None:
        """Gather each row's valid entries to the right end of a width of max(lengths) columns."""
        width = int(self.lengths.max())
        order = torch.argsort(self.mask, dim=1, stable=True)[:, -width:]  # valid columns, in order, last
        for layer in self.cache.layers:
            layer.keys = _gather_columns(layer.keys, order)
            layer.values = _gather_columns(layer.values, order)
        self.mask = self.mask.gather(1, order)

    def _crop_unused_tail(self) -> None:
        """Drop trailing columns that no row uses any more."""
        used = self.mask.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if len(used) else 0
        if width < self.mask.shape[1]:
            self.cache.crop(width - self.mask.shape[1])
            self.mask = self.mask[:, :width]

    def _compact_if_sparse(self) -> None:
        holes = self.holes()
        if holes >= COMPACT_MIN_COLUMNS and holes >= COMPACT_SHARE * self.mask.shape[1]:
            self.compact()

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_to_keep: int | torch.Tensor,
        **inputs: torch.Tensor,
    ) -> Any:
        # Without holes the mask says nothing the causal mask does not: skip building a 4-D mask.
        attention_mask = None if bool(self.mask.all()) else self.mask
        captured: dict[int, torch.Tensor] = {}
        hooks = capture_hidden_states(self.model, self.feature_layers, captured)
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions,
                cache=self.cache,
                logits_to_keep=logits_to_keep,
                **inputs,
            )
        finally:
            for hook in hooks:
                hook.remove()
        if self.feature_layers:
            self.features = torch.cat([captured[i] for i in self.feature_layers], dim=-1)
        return out


def capture_hidden_states(
    model: torch.nn.Module, indices: Sequence[int], into: dict[int, torch.Tensor]
) -> list[torch.utils.hooks.RemovableHandle]:
    """Forward hooks that store transformers' `hidden_states[i]` for each index (0 = embeddings,
    i = output of decoder layer i - 1, the last = after the final norm) in `into` on every pass:
    just these layers, where `output_hidden_states` would keep every layer's activations. The
    caller removes the handles. Hooks sit on the target's own modules, so a model sharing them
    (its shallow early-exit copy) fills them too."""
    if not indices:
        return []
    decoder = model.model
    count = len(decoder.layers)

    def hook(index: int) -> torch.utils.hooks.RemovableHandle:
        module = decoder.embed_tokens if index == 0 else decoder.norm if index == count else decoder.layers[index - 1]

        def keep(_module: torch.nn.Module, _args: object, output: object) -> None:
            into[index] = output[0] if isinstance(output, tuple) else output  # type: ignore[assignment]

        return module.register_forward_hook(keep)

    return [hook(i) for i in indices]


def _gather_columns(states: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """states (B, heads, T, dim) with columns picked per row by order (B, T')."""
    index = order[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
    return states.gather(2, index)
