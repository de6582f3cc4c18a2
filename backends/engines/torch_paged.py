"""The torch engine: a transformers model over specroute's paged KV cache (`backends.kv`).

It is the exact reference (float32 greedy verification passes give the tokens 1-token decoding
gives) and serves every drafter: those reading the target's hidden states (`features`), its own
layers, and tree-shaped blocks (`BlockStructure`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..kv import PagedCache

if TYPE_CHECKING:
    from ..speculative.drafters import Drafter
    from . import EngineName


class TorchPagedEngine(PagedCache):
    """`PagedCache` as the step loop's engine: the cache runs the model's passes itself."""

    name: EngineName = "torch"

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (what q and the logits are indexed by)."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def sequence_tokens(self) -> int:
        """The most tokens one sequence may hold: the whole pool."""
        return (self.max_blocks - 1) * self.block_tokens

    def refusal(self, drafter: Drafter) -> str | None:
        return None

    def close(self) -> None:
        """Nothing to free before the garbage collector: the pool is torch tensors."""
