"""What the router expects each backend's prefix cache to hold: the chains of full prompt blocks
of the requests it sent there (keyed as the backends key them, `policies.prefix`, rooted in the
request's `cache_salt`), forgotten least recently used first once a backend's KV pool could not
hold more. An estimate, as llm-d's and Ray Serve's prefix-aware routers keep one: a backend may
have evicted sooner (its pool also holds answers and running rows) or hold more (the answers it
registered); the policy reads it to predict time to first token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from policies.prefix import BLOCK_TOKENS, chain_keys, root_key

SCOPE = b"router"  # one router's estimate: its keys are compared with its own only


class PrefixIndex:
    """Per holder (a backend, or one replica of a backend), the prompt blocks it was sent recently
    (see the module docstring)."""

    def __init__(self, capacity_blocks: int, holders: Sequence[str] | None):
        """`capacity_blocks`: what one holder's KV pool holds, in blocks (0: no prefix caching);
        `holders`: the ones that cache (None: any a prompt is sent to, as replicas come and go)."""
        self.capacity = capacity_blocks
        self.open = holders is None
        self.blocks: dict[str, OrderedDict[bytes, None]] = {b: OrderedDict() for b in holders or ()}

    def cached_tokens(self, backend: str, ids: Sequence[int], salt: str | None = None) -> int:
        """Prompt tokens `backend` is expected to find cached (never the last one: it is always fed)."""
        return self.cached(ids, salt).get(backend, 0)

    def cached(self, ids: Sequence[int], salt: str | None = None) -> dict[str, int]:
        """Per holder expected to hold some of the prompt, the tokens it holds; each block's key is
        computed once for every holder, and hashing stops at the first block none of them holds."""
        holding = [h for h, held in self.blocks.items() if held]
        found: dict[str, int] = {}
        for n, key in enumerate(chain_keys(ids, root_key(SCOPE, salt)), start=1):
            holding = [h for h in holding if key in self.blocks[h]]
            if not holding:
                break
            found.update(dict.fromkeys(holding, n * BLOCK_TOKENS))
        return found

    def sent(self, backend: str, ids: Sequence[int], salt: str | None = None) -> None:
        """The prompt went to `backend`: its blocks are cached there now, the most recently used."""
        if not self.capacity:
            return
        held = self.blocks.setdefault(backend, OrderedDict()) if self.open else self.blocks.get(backend)
        if held is None:
            return
        for key in chain_keys(ids, root_key(SCOPE, salt)):
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, holder: str) -> None:
        """`holder` is gone (a replica died or was removed): whatever replaces it starts empty."""
        self.blocks.pop(holder, None)
