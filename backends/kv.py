"""A paged KV cache shared by every engine: sequences own blocks of one pool, so a sequence that
joins, grows, is cut back (rejected drafts) or leaves never moves or recomputes another
sequence's keys and values.

Each layer keeps one key pool and one value pool of shape (tokens, kv heads, head dim), split
into blocks of `block_tokens`; a sequence holds a block table and a length. A forward pass feeds
any subset of sequences a right-padded block of new tokens each: the attention layers call
`update`, which writes the new keys and values into the sequences' blocks (padding goes to a
scratch block nobody reads) and hands attention each sequence's keys gathered in order, with a
4-D mask that shows every real query exactly its own sequence's tokens up to itself. Positions
are per sequence, so padding never shifts a rotary phase.

Width-invariant passes (`tile`): in bfloat16 a token's logits depend on how many positions the
pass computes beside it (matrix kernels and attention pick different blockings, so different
reduction orders, for different shapes), so a token verified in a block of k + 1 can differ from
the same token decoded alone. With a tile W, every pass that decodes or verifies runs W positions
(real tokens first, padding after, which causal attention keeps away from them), and every pass's
key columns are whole attention splits (`ATTENTION_SPLIT`: the CPU flash-attention kernel's key
block, so a key block's reduction never depends on how many masked columns follow). A token's
logits are then the same bits whether it was decoded alone or verified in a block. Only the real
positions' logits are computed: the LM head's rows do not depend on how many rows it has. With
`tile_rows`, only passes of at most that many sequences are tiled: a W-wide pass costs W times the
compute, which a lone sequence's memory-bound pass hides and a large batch's compute-bound one
does not; bigger passes run at natural widths.

Memory is bounded: the pool grows by doubling up to `max_tokens` and never past it (one layer
at a time, so growing holds at most one layer's pools twice); `reserve` lets a scheduler admit
only what is sure to fit, so the target's cache never runs out mid-run. A drafter's own cache
holds one entry per token of the rows it drafts for, which the target's bound bounds in turn.

Prefix caching (`prefix_caching`): a full block whose tokens are verified context (a prompt's, or
a finished answer's) is registered under a key chained over every token before it — the hash of
(its parent block's key, its token ids), rooted in the cache's identity (model, dtype, pass
shapes) and the request's `salt` — as vLLM's automatic prefix caching keys blocks. A new sequence
given its prompt (`add(prefix=…)`) starts holding the longest chain of registered blocks and
prefills only the rest (at least its last token, whose logits it samples from). Blocks are
reference-counted: shared ones are read by every sequence holding them and written by none (a
sequence writes only past its length, and registered blocks are full). A block no sequence holds
any more stays registered and reusable, in LRU order, until the pool needs it. Tokens of an
unverified draft are never registered: the caller registers (`commit`) only what it verified.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from policies.prefix import BLOCK_TOKENS, block_key, chain_keys, root_key

from .errors import ModelLoadError

ATTENTION_SPLIT = 512  # torch's CPU flash attention reads keys in blocks of this many columns
FIRST_POOL_BLOCKS = 64  # the pool starts this small and doubles on demand
UNBOUNDED_TOKENS = 1 << 24  # for caches whose use another, bounded cache already limits


class CacheFull(RuntimeError):
    """The pool has no room for what was asked: the scheduler should have reserved first."""


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose keys and values are valid
    reserved: int = 0  # tokens promised to this sequence (blocks it may still claim)
    chain: list[bytes] = field(default_factory=list)  # prefix-cache keys of its leading full blocks
    root: bytes = b""  # the key its first block's chains from (identity and salt)
    cached: int = 0  # prompt tokens it found in the prefix cache instead of computing them


@dataclass
class PrefixStats:
    """Prefix-cache lookups since the cache was made, in tokens (vLLM's prefix_cache_queries and
    prefix_cache_hits): every prompt looked up, and the tokens found."""

    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class BlockStructure:
    """A row's new tokens that are not one chain (lookahead's Jacobi window and candidate
    n-grams): token i of the block is computed at position start + offsets[i] and attends to the
    whole cached context and to the block's tokens j where sees[i, j]. Its keys and values are
    written in block order whatever the positions, so a chain placed first in the block (the
    verified tokens) is kept by `truncate` and the rest is dropped with it."""

    offsets: torch.Tensor  # (L,) long, offsets[i] ≥ 0
    sees: torch.Tensor  # (L, L) bool, sees[i, i] true

    def __post_init__(self) -> None:
        length = self.offsets.shape[0]
        if self.sees.shape != (length, length) or not bool(self.sees.diagonal().all()):
            raise ValueError("a block structure needs an (L, L) visibility with every token seeing itself")
        if bool((self.offsets < 0).any()):
            raise ValueError("a block token cannot sit before the cached context")


@dataclass
class _Pass:
    """What `update` needs during one forward: where the new tokens go and what to read back."""

    write: torch.Tensor  # (B·W,) pool token index of each new position (padding → scratch)
    read: torch.Tensor  # (B·T,) pool token index of each key column attention reads
    batch: int
    columns: int


class PagedCache:
    """The KV cache of one model for many sequences, addressed by integer sequence ids."""

    is_compileable = False

    def __init__(
        self,
        model: PreTrainedModel,
        max_tokens: int,
        block_tokens: int = BLOCK_TOKENS,
        feature_layers: Sequence[int] = (),
        tile: int | None = None,
        tile_rows: int | None = None,
        prefix_caching: bool = False,
    ):
        """`max_tokens`: the most tokens (over all sequences) the pool may ever hold. With
        `feature_layers`, every forward also keeps those hidden states (see `features`). With
        `tile`, passes are width-invariant (see the module docstring): every pass that keeps all
        positions' logits runs `tile` positions wide — every pass of at most `tile_rows` sequences
        (None: every pass). `prefix_caching`: see the module docstring."""
        check_full_attention(model)
        config = model.config
        self.model = model
        self.block_tokens = block_tokens
        self.max_blocks = max(2, math.ceil(max_tokens / block_tokens) + 1)  # + the scratch block
        self.feature_layers = tuple(feature_layers)
        self.tile = tile
        self.tile_rows = tile_rows
        self.hidden_states: dict[int, torch.Tensor] = {}
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, _cache_dtype(model)
        self.layers = config.num_hidden_layers
        self.head_shape = kv_head_shape(config)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.free: list[int] = []
        self._allocate_pool(min(FIRST_POOL_BLOCKS, self.max_blocks))
        self.prefix_caching = prefix_caching
        self.prefix_stats = PrefixStats()
        # What makes two caches' keys and values for the same tokens the same bits: a block is
        # only ever found by sequences of this cache, but the key says what it was computed by.
        shape = f"tile={tile}/{tile_rows}"
        self._identity = f"{type(model).__name__}|{config.name_or_path}|{self.dtype}|{shape}".encode()
        self._refs: dict[int, int] = {}  # block → sequences holding it (every held block)
        self._registered: dict[bytes, int] = {}  # prefix-cache key → block
        self._key_of: dict[int, bytes] = {}  # registered block → its key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by none: oldest first
        self.sequences: dict[int, _Sequence] = {}
        self._next_id = 0
        self._pass: _Pass | None = None

    # -- sequences --------------------------------------------------------------------------
    def add(self, reserve: int = 0, prefix: Sequence[int] = (), salt: str | None = None) -> int:
        """A new sequence; `reserve` tokens are promised to it (see `can_reserve`). Given its
        `prefix` (the prompt) with prefix caching on, it starts with the longest chain of cached
        blocks of that prefix (of requests with the same `salt`) as its first `length` tokens."""
        if not self.can_reserve(reserve, prefix, salt):
            raise CacheFull(f"no room to reserve {reserve} tokens")
        seq = self._next_id
        self._next_id += 1
        self.sequences[seq] = state = _Sequence(reserved=reserve, root=self._root(salt))
        if self.prefix_caching and prefix:
            self.prefix_stats.queries += len(prefix)
        self._extend(state, prefix)
        return seq

    def cached_tokens(self, seq: int) -> int:
        """Prompt tokens the sequence found in the prefix cache (when it joined, and by `adopt`)."""
        return self.sequences[seq].cached

    def adopt(self, seq: int, prefix: Sequence[int]) -> int:
        """Extend a sequence still being prefilled with the cached blocks that continue its chain
        over `prefix` — blocks another sequence registered after this one joined (requests that
        arrived together and share a system prompt) — instead of computing them again. Only at a
        block boundary, with every block it holds full and keyed. Returns the tokens gained."""
        state = self.sequences[seq]
        return self._extend(state, prefix) if self._at_keyed_boundary(state) else 0

    def next_key(self, seq: int, prefix: Sequence[int]) -> bytes | None:
        """The key of the next full block the sequence would compute from `prefix` and then offer
        to others (None when prefix caching is off, it is not at a keyed block boundary, or no
        cacheable block is left): two sequences with the same next key compute the same block."""
        state = self.sequences[seq]
        if not self.prefix_caching or not self._at_keyed_boundary(state):
            return None
        return next(self._chain_keys(state, prefix), None)

    def commit(self, seq: int, tokens: Sequence[int]) -> None:
        """Register the sequence's full blocks whose tokens — `tokens`, its verified context from
        position 0 on — are all in the cache, so later sequences can start from them. Positions
        past `tokens` (drafts not yet verified) are never registered."""
        state = self.sequences.get(seq)
        if not self.prefix_caching or state is None:
            return
        bs = self.block_tokens
        full = min(len(tokens), state.length) // bs
        for i in range(len(state.chain), full):
            parent = state.chain[-1] if state.chain else state.root
            key = block_key(parent, tokens[i * bs : (i + 1) * bs])
            state.chain.append(key)
            block = state.blocks[i]
            if key not in self._registered and block not in self._key_of:  # else a twin is already cached
                self._registered[key], self._key_of[block] = block, key

    def remove(self, seq: int) -> None:
        """The sequence leaves: its blocks return to the pool at once (registered ones stay
        findable until the pool needs them; the last block first, so chains lose their tails first)."""
        state = self.sequences.pop(seq)
        for block in reversed(state.blocks):
            self._release(block)

    def length(self, seq: int) -> int:
        return self.sequences[seq].length

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first `length` tokens (rejected drafts are forgotten; their blocks freed)."""
        state = self.sequences[seq]
        if not 0 <= length <= state.length:
            raise ValueError(f"truncate can only shorten a sequence ({state.length} → {length})")
        state.length = length
        keep = math.ceil(length / self.block_tokens)
        for block in reversed(state.blocks[keep:]):
            self._release(block)
        del state.blocks[keep:]
        del state.chain[length // self.block_tokens :]
        if length % self.block_tokens and self._shared(state.blocks[-1]):
            state.blocks[-1] = self._copy_of(state.blocks[-1])  # it will be written past `length`

    def keep_branch(self, seq: int, start: int, kept: Sequence[int]) -> None:
        """After a structured pass that began at `start`: keep the block tokens at indices `kept`
        (a root and one accepted branch, in order) as the sequence's tokens start, start + 1, …,
        moving their keys and values into place, and forget the rest of the block."""
        state = self.sequences[seq]
        if any(i < 0 or start + i >= state.length for i in kept) or start > state.length:
            raise ValueError(f"kept block indices {list(kept)} lie outside the pass at {start}")

        def slot(position: int) -> int:
            return state.blocks[position // self.block_tokens] * self.block_tokens + position % self.block_tokens

        source = torch.tensor([slot(start + i) for i in kept], dtype=torch.long, device=self.device)
        target = torch.tensor([slot(start + j) for j in range(len(kept))], dtype=torch.long, device=self.device)
        for pool in (*self.keys, *self.values):  # index_select copies first, so overlaps are safe
            pool.index_copy_(0, target, pool.index_select(0, source))
        self.truncate(seq, start + len(kept))

    def fill(self, seq: int, count: int) -> None:
        """`count` tokens of placeholder context (zero keys and values, no forward pass): for timing
        passes, whose cost depends on how long the context is, never on what it holds."""
        self._grow(seq, count)

    def can_reserve(self, tokens: int, prefix: Sequence[int] = (), salt: str | None = None, growing: int = 0) -> bool:
        """Would a sequence promised `tokens` fit beside every reservation already made, leaving a
        block for each of `growing` sequences to grow into? With its `prefix`, cached blocks it
        would share count as held already (and idle cached ones it would take back as spent)."""
        found = [block for _, block in self._lookup(chain_keys(prefix, self._root(salt), self.block_tokens))]
        revived = sum(block in self._evictable for block in found)
        return self._blocks_for(tokens) - len(found) + revived + growing <= self._unpromised_blocks()

    def spare_blocks(self) -> int:
        """Blocks no sequence holds or was promised: what sequences growing past their promise share."""
        return self._unpromised_blocks()

    def growth_blocks(self, seq: int, tokens: int) -> int:
        """Blocks the sequence would take beyond what it holds and was promised, for `tokens` more."""
        state = self.sequences[seq]
        owned = max(len(state.blocks), self._blocks_for(state.reserved))
        return max(self._blocks_for(state.length + tokens) - owned, 0)

    @property
    def usage(self) -> float:
        """Share of the pool's bound held by sequences now (vLLM's kv_cache_usage_perc, as 0..1)."""
        return self._used_blocks() / (self.max_blocks - 1)

    def _unpromised_blocks(self) -> int:
        promised = sum(max(self._blocks_for(s.reserved) - len(s.blocks), 0) for s in self.sequences.values())
        return self.max_blocks - 1 - self._used_blocks() - promised

    def _used_blocks(self) -> int:
        """Blocks some sequence holds (a shared block once): idle cached blocks are free to reuse."""
        return len(self._refs)

    # -- prefix cache -----------------------------------------------------------------------
    def _root(self, salt: str | None) -> bytes:
        return root_key(self._identity, salt)

    def _lookup(self, keys: Iterator[bytes]) -> list[tuple[bytes, int]]:
        """The registered blocks of a chain of `keys`, up to the first one not cached: (key, block)
        pairs."""
        if not self.prefix_caching:
            return []
        found = []
        for key in keys:
            block = self._registered.get(key)
            if block is None:
                break
            found.append((key, block))
        return found

    def _chain_keys(self, state: _Sequence, prefix: Sequence[int]) -> Iterator[bytes]:
        """The keys of `prefix`'s full blocks past those the sequence holds keyed."""
        parent = state.chain[-1] if state.chain else state.root
        return chain_keys(prefix, parent, self.block_tokens, start=len(state.chain))

    def _at_keyed_boundary(self, state: _Sequence) -> bool:
        """Every block the sequence holds is full and keyed: it may go on with cached blocks."""
        return state.length == len(state.chain) * self.block_tokens == len(state.blocks) * self.block_tokens

    def _extend(self, state: _Sequence, prefix: Sequence[int]) -> int:
        """The sequence takes the cached blocks that continue its chain over `prefix`; the tokens gained."""
        found = self._lookup(self._chain_keys(state, prefix))
        for key, block in found:
            self._hold(block)
            state.blocks.append(block)
            state.chain.append(key)
        gained = len(found) * self.block_tokens
        state.length += gained
        state.cached += gained
        self.prefix_stats.hits += gained
        return gained

    def _hold(self, block: int) -> None:
        self._evictable.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            return
        del self._refs[block]
        if block in self._key_of:
            self._evictable[block] = None  # found again until the pool needs it
        else:
            self.free.append(block)

    def _shared(self, block: int) -> bool:
        return self._refs.get(block, 0) > 1 or block in self._key_of

    def _copy_of(self, block: int) -> int:
        """A private copy of a shared block (the caller's sequence will write into it)."""
        fresh = self._take_block()
        bs = self.block_tokens
        source = torch.arange(block * bs, (block + 1) * bs, device=self.device)
        target = torch.arange(fresh * bs, (fresh + 1) * bs, device=self.device)
        for pool in (*self.keys, *self.values):
            pool.index_copy_(0, target, pool.index_select(0, source))
        self._release(block)
        return fresh

    def _take_block(self) -> int:
        """A block for new tokens: a free one, else the pool grown, else the least recently used
        idle cached block (forgotten)."""
        if not self.free:
            total = self.keys[0].shape[0] // self.block_tokens
            if total < self.max_blocks:
                self._allocate_pool(min(2 * total, self.max_blocks))
            elif self._evictable:
                block, _ = self._evictable.popitem(last=False)
                del self._registered[self._key_of.pop(block)]
                self.free.append(block)
            else:
                raise CacheFull(f"the KV pool is full ({self.max_blocks - 1} blocks of {self.block_tokens} tokens)")
        block = self.free.pop()
        self._refs[block] = 1
        return block

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    # -- forward passes ---------------------------------------------------------------------
    def forward(
        self,
        seqs: Sequence[int],
        blocks: Sequence[Sequence[int]],
        width: int | None = None,
        keep: str = "all",
        structures: Sequence[BlockStructure | None] | None = None,
        **inputs: torch.Tensor,
    ) -> Any:
        """Feed each sequence its block of new tokens (blocks may differ in length, even be empty)
        in one pass; the model's output with logits at every block position, (B, W, V), or with
        keep="last" only after each sequence's last new token, (B, V). The block is right-padded
        to `width` (≥ the longest block). `inputs` are extra per-position model inputs laid out
        like the padded block (B, W, …), e.g. the features an EAGLE head reads. `structures`
        gives a row's block other positions and visibility than one causal chain."""
        counts = [len(b) for b in blocks]
        structures = _checked_structures(structures, counts)
        width = max(max(counts, default=1), 1) if width is None else width
        tiled = self.tiles(len(seqs))
        if tiled and keep == "all":
            width = max(width, self.tile)
            if width > self.tile:
                raise ValueError(f"a width-invariant pass is {self.tile} positions wide; {width} were asked for")
        if width < max(counts, default=0):
            raise ValueError(f"width {width} is narrower than the longest block ({max(counts)})")
        starts = [self.sequences[s].length for s in seqs]
        for seq, count in zip(seqs, counts, strict=True):
            self._grow(seq, count)
        # Padding may be any id the embedding reads: its positions are masked out and never sampled.
        input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, block in enumerate(blocks):
            input_ids[row, : len(block)] = torch.tensor(list(block), dtype=torch.long)
        positions, mask = self._plan(seqs, starts, counts, width, tiled, structures)
        logits_to_keep: int | torch.Tensor = width
        if tiled:  # padding's logits are never read
            logits_to_keep = torch.arange(max(max(counts, default=1), 1), device=self.device)
        columns = None
        if keep == "last":
            wanted = sorted({max(c, 1) - 1 for c in counts})
            logits_to_keep = torch.tensor(wanted, device=self.device)
            columns = torch.tensor([wanted.index(max(c, 1) - 1) for c in counts], device=self.device)
        try:
            out = self._model_forward(input_ids.to(self.device), positions, mask, logits_to_keep, **inputs)
        finally:
            self._pass = None
        if columns is not None:
            rows = torch.arange(len(seqs), device=self.device)
            out.logits = out.logits[rows, columns]
            if getattr(out, "hidden", None) is not None:
                out.hidden = out.hidden[rows, columns]
        return out

    def logits(
        self,
        seqs: Sequence[int],
        blocks: Sequence[Sequence[int]],
        width: int | None = None,
        structures: Sequence[BlockStructure | None] | None = None,
    ) -> torch.Tensor:
        """Logits at every block position, (B, W, V)."""
        return self.forward(seqs, blocks, width, structures=structures).logits

    def last_logits(self, seqs: Sequence[int], blocks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits after each sequence's last new token, (B, V): a long catch-up or prompt chunk
        then costs no LM-head work for positions nobody samples from."""
        return self.forward(seqs, blocks, keep="last").logits

    def _grow(self, seq: int, count: int) -> None:
        """Give the sequence blocks for `count` more tokens and count them as valid."""
        state = self.sequences[seq]
        needed = self._blocks_for(state.length + count) - len(state.blocks)
        if needed > len(self.free) + self._evictable_or_growable():
            raise CacheFull(f"the KV pool is full ({self.max_blocks - 1} blocks of {self.block_tokens} tokens)")
        state.blocks.extend(self._take_block() for _ in range(needed))
        state.length += count

    def _evictable_or_growable(self) -> int:
        """Blocks beyond the free list that `_take_block` can still find."""
        return len(self._evictable) + self.max_blocks - self.keys[0].shape[0] // self.block_tokens

    def _allocate_pool(self, blocks: int) -> None:
        """Grow every layer's pools to `blocks` blocks (block 0 is the scratch block for padding)."""
        old = self.keys[0].shape[0] // self.block_tokens if self.keys else 0
        shape = (blocks * self.block_tokens, *self.head_shape)

        def grown(pool: torch.Tensor | None) -> torch.Tensor:
            fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if pool is not None:
                fresh[: pool.shape[0]] = pool
            return fresh

        if self.keys:
            for i in range(self.layers):  # in place, layer by layer: the old pools go as the new arrive
                self.keys[i], self.values[i] = grown(self.keys[i]), grown(self.values[i])
        else:
            self.keys = [grown(None) for _ in range(self.layers)]
            self.values = [grown(None) for _ in range(self.layers)]
        self.free.extend(range(max(old, 1), blocks))

    def tiles(self, rows: int) -> bool:
        """Whether a pass over `rows` sequences is width-invariant."""
        return self.tile is not None and (self.tile_rows is None or rows <= self.tile_rows)

    def _plan(
        self,
        seqs: Sequence[int],
        starts: list[int],
        counts: list[int],
        width: int,
        tiled: bool,
        structures: Sequence[BlockStructure | None] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions (B, W) and the boolean attention mask (B, 1, W, T); sets up `update`."""
        bs = self.block_tokens
        batch = len(seqs)
        columns = max(max(s + c for s, c in zip(starts, counts, strict=True)), 1)
        split = ATTENTION_SPLIT if tiled else bs
        columns = math.ceil(columns / split) * split
        start = torch.tensor(starts, dtype=torch.long).unsqueeze(1)
        count = torch.tensor(counts, dtype=torch.long).unsqueeze(1)
        offsets = torch.arange(width).unsqueeze(0)
        real = offsets < count
        # Padding repeats the row's last position: it must never index past the context
        # (learned position tables) or stretch rotary scaling, and nobody reads its keys.
        slots = torch.where(real, start + offsets, (start + count - 1).clamp(min=0))
        positions = slots.clone()
        for row, structure in enumerate(structures):
            if structure is not None:
                positions[row, : counts[row]] = starts[row] + structure.offsets
        tables = torch.zeros((batch, columns // bs), dtype=torch.long)
        for row, seq in enumerate(seqs):
            owned = self.sequences[seq].blocks
            tables[row, : len(owned)] = torch.tensor(owned, dtype=torch.long)
        token_index = (tables.unsqueeze(2) * bs + torch.arange(bs)).reshape(batch, columns)
        write = torch.where(real, token_index.gather(1, slots), torch.zeros_like(slots))
        # Query i of a row sees its own tokens up to itself; padding queries see the row's real
        # tokens (or column 0), so no query is left with nothing to attend to.
        visible = torch.where(real, start + offsets, start + count - 1)
        mask = torch.arange(columns).view(1, 1, columns) <= visible.unsqueeze(2)
        mask[:, :, 0] |= True
        for row, structure in enumerate(structures):
            if structure is not None:
                begin, count_ = starts[row], counts[row]
                mask[row, :count_, begin : begin + count_] = structure.sees
        self._pass = _Pass(write.reshape(-1).to(self.device), token_index.reshape(-1).to(self.device), batch, columns)
        return positions.to(self.device), mask.unsqueeze(1).to(self.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What each attention layer calls: store (B, heads, W, D) new keys and values, return
        every row's keys and values (B, heads, T, D) in position order."""
        plan = self._pass
        assert plan is not None, "update outside a PagedCache.forward"
        heads, dim = self.head_shape
        for pool, new in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            pool.index_copy_(0, plan.write, new.transpose(1, 2).reshape(-1, heads, dim).to(pool.dtype))
        shape = (plan.batch, plan.columns, heads, dim)
        keys = self.keys[layer_idx].index_select(0, plan.read).view(shape).transpose(1, 2)
        values = self.values[layer_idx].index_select(0, plan.read).view(shape).transpose(1, 2)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and masks always come explicitly

    def _model_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        logits_to_keep: int | torch.Tensor,
        **inputs: torch.Tensor,
    ) -> Any:
        captured: dict[int, torch.Tensor] = {}
        hooks = capture_hidden_states(self.model, self.feature_layers, captured)
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                cache=self,
                logits_to_keep=logits_to_keep,
                **inputs,
            )
        finally:
            for hook in hooks:
                hook.remove()
        self.hidden_states = captured
        return out

    def features(self, layers: Sequence[int]) -> torch.Tensor:
        """The last pass's hidden states at `layers` (a subset of `feature_layers`), concatenated:
        (B, W, len(layers) · H) over the positions just fed."""
        return torch.cat([self.hidden_states[i] for i in layers], dim=-1)


def _checked_structures(
    structures: Sequence[BlockStructure | None] | None, counts: list[int]
) -> Sequence[BlockStructure | None]:
    if structures is None:
        return [None] * len(counts)
    if len(structures) != len(counts):
        raise ValueError(f"{len(structures)} block structures for {len(counts)} rows")
    for structure, count in zip(structures, counts, strict=True):
        if structure is not None and structure.offsets.shape[0] != count:
            raise ValueError(f"a block structure of {structure.offsets.shape[0]} tokens for a block of {count}")
    return structures


def check_full_attention(model: PreTrainedModel) -> None:
    """Refuse models with sliding-window or linear-attention layers: their state is not a list
    of per-position keys and values that blocks can hold and cut back."""
    layers = DynamicCache(config=model.config).layers
    if not all(type(layer) is DynamicLayer for layer in layers):
        raise ModelLoadError(
            f"the step loop needs full-attention layers; {type(model).__name__} uses sliding-window or "
            "linear-attention layers, whose state cannot be kept in blocks and rolled back"
        )


def kv_head_shape(config: object) -> tuple[int, int]:
    """(key/value heads, head size) of a model's attention layers."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one cached token takes in a `PagedCache` of this model: keys and values, every layer."""
    itemsize = torch.empty((), dtype=_cache_dtype(model)).element_size()
    return kv_values_per_token(model) * itemsize


def kv_values_per_token(model: torch.nn.Module) -> int:
    """Values one cached token holds: keys and values of every KV head of every layer."""
    heads, head_dim = kv_head_shape(model.config)
    return 2 * model.config.num_hidden_layers * heads * head_dim


def _cache_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the attention layers produce keys in: the first floating-point parameter's (an
    int8 model keeps its norms and embeddings in float)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


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
