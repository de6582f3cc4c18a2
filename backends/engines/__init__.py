"""The engines the step loop drives: what holds a replica's KV cache and runs its target passes.

The scheduler (`backends.scheduler`) talks to its target through one narrow interface, `Engine`:
sequences that join (`add`), grow by blocks of new tokens fed in one pass (`logits`,
`last_logits`), are cut back past rejected drafts (`truncate`) and leave (`remove`), with
admission asking `can_reserve` first. Two implementations exist:

- `torch_paged.TorchPagedEngine` — the transformers model over specroute's own paged KV cache
  (`backends.kv`): the exact float reference, and the only engine that serves drafters reading the
  target's hidden states (EAGLE, Medusa), its own layers (early exit) or tree-shaped blocks
  (lookahead);
- `llamacpp.LlamaCppEngine` — a `.gguf` model in llama.cpp (`llama-cpp-python`'s batch API), one
  context per replica with a sequence per row: the engine CPU users already run, under the same
  loop, drafters and policy.

`policies.engines.ENGINES` names them once; `LoopSettings.engine` picks one per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from policies.engines import ENGINES, EngineName, GgufWeights

from ..errors import ModelLoadError

if TYPE_CHECKING:
    from ..kv import BlockStructure, PrefixStats
    from ..models import LoadedModel
    from ..scheduler import LoopSettings
    from ..speculative.drafters import Drafter

__all__ = ["ENGINES", "Engine", "EngineName", "build_engine", "gguf_file"]


class Engine(Protocol):
    """What the step loop needs of the target: see the module docstring."""

    name: EngineName
    device: torch.device

    @property
    def vocab_size(self) -> int: ...

    @property
    def usage(self) -> float: ...

    @property
    def sequence_tokens(self) -> int:
        """The most tokens one sequence may ever hold (a longer request is refused at once)."""
        ...

    @property
    def prefix_stats(self) -> PrefixStats:
        """Prefix-cache lookups so far, in tokens (zeros where the engine keeps no prefix cache)."""
        ...

    def add(self, reserve: int = 0, prefix: Sequence[int] = (), salt: str | None = None) -> int:
        """A new sequence promised `reserve` tokens; given its `prefix` (the prompt), an engine with
        a prefix cache starts it holding the cached blocks of that prefix (`length` says how many
        tokens), shared only among requests of the same `salt`."""
        ...

    def cached_tokens(self, seq: int) -> int:
        """Prompt tokens the sequence found cached instead of computing them."""
        ...

    def commit(self, seq: int, tokens: Sequence[int]) -> None:
        """`tokens` are the sequence's verified context from position 0: its full blocks may be
        cached for later sequences."""
        ...

    def adopt(self, seq: int, prefix: Sequence[int]) -> int:
        """A sequence still being prefilled takes the cached blocks that continue it over `prefix`
        (cached since it joined); the tokens it gained (0 without a prefix cache)."""
        ...

    def next_key(self, seq: int, prefix: Sequence[int]) -> bytes | None:
        """The cache key of the next block the sequence would compute from `prefix` (None without a
        prefix cache): sequences with the same next key would compute the same block."""
        ...

    def remove(self, seq: int) -> None: ...

    def length(self, seq: int) -> int: ...

    def truncate(self, seq: int, length: int) -> None: ...

    def keep_branch(self, seq: int, start: int, kept: Sequence[int]) -> None: ...

    def can_reserve(self, tokens: int, prefix: Sequence[int] = (), salt: str | None = None, growing: int = 0) -> bool:
        """Room for a new sequence promised `tokens` (sharing the cached blocks of `prefix`), with a
        block left for each of `growing` running sequences to grow into."""
        ...

    def spare_blocks(self) -> int:
        """Room no sequence holds or was promised, in blocks (what sequences grow into)."""
        ...

    def growth_blocks(self, seq: int, tokens: int) -> int:
        """Blocks the sequence would take from the spare room to hold `tokens` more."""
        ...

    def logits(
        self,
        seqs: Sequence[int],
        blocks: Sequence[Sequence[int]],
        width: int | None = None,
        structures: Sequence[BlockStructure | None] | None = None,
    ) -> torch.Tensor: ...

    def last_logits(self, seqs: Sequence[int], blocks: Sequence[Sequence[int]]) -> torch.Tensor: ...

    def features(self, layers: Sequence[int]) -> torch.Tensor: ...

    def refusal(self, drafter: Drafter) -> str | None:
        """Why this engine cannot serve `drafter` (None: it can)."""
        ...

    def close(self) -> None:
        """Free what the engine holds outside Python's memory now (a llama.cpp context)."""
        ...


def build_engine(
    loaded: LoadedModel, settings: LoopSettings, feature_layers: Sequence[int] = (), tile: int | None = None
) -> Engine:
    """The engine `settings.engine` names for this target, sized by the loop's settings."""
    if settings.engine == "llamacpp":
        from .llamacpp import LlamaCppEngine

        threads = torch.get_num_threads()  # the replica's thread cap applies to both engines
        return LlamaCppEngine(
            gguf_file(loaded, settings.gguf_weights),
            settings.cache_tokens,
            settings.max_batch,
            threads,
            settings.max_step_tokens,
        )
    from .torch_paged import TorchPagedEngine

    return TorchPagedEngine(
        loaded.model,
        settings.cache_tokens,
        feature_layers=feature_layers,
        tile=tile,
        tile_rows=settings.tile_max_rows,
        prefix_caching=settings.prefix_caching and caches_exactly(loaded.info.dtype),
    )


def caches_exactly(dtype: str) -> bool:
    """Whether a cached prefix leaves the tokens of a torch target computing in `dtype` (its
    `ModelInfo.dtype`: a quantized target's is its method) unchanged: in float32 a token's keys are
    the same whichever prefill chunk computed them (tested); in bfloat16 and through torch's int
    kernels they round differently with a pass's width, so a hit could change the answer — there
    every prompt is prefilled in full."""
    return dtype == "float32"


def gguf_file(loaded: LoadedModel, weights: GgufWeights = "file") -> Path:
    """The `.gguf` file a llama.cpp engine serves for this target: the file it was loaded from, or
    that file requantized to `weights` (made once, then reused)."""
    if loaded.gguf is None:
        raise ModelLoadError(
            f"the llama.cpp engine serves GGUF files; {loaded.info.name} was loaded from another format: "
            "pass a .gguf model (or the embedded one), or use engine torch"
        )
    if weights == "file":
        return loaded.gguf
    from .llamacpp import requantized

    return requantized(loaded.gguf, weights)
