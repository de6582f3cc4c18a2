"""Keys of prefix-cache blocks, shared by the backends' KV pool (`backends.kv`) and the router's
estimate of what each backend holds (`router.prefix_index`): a full block of `BLOCK_TOKENS` tokens is
keyed by a hash of its parent block's key and its token ids, so a key stands for every token
before it too (vLLM's automatic prefix caching keys blocks the same way)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

BLOCK_TOKENS = 16  # the step loop's KV block: the unit of its memory and of prefix caching


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A block's key: its parent's key and its token ids, hashed (128 bits: a collision would hand
    a sequence another prompt's keys and values)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return digest.digest()


def root_key(scope: bytes, salt: str | None) -> bytes:
    """Where a prompt's chain of keys starts: what computed the blocks (`scope`) and the request's
    salt — prompts of different salts never share a block."""
    return hashlib.blake2b(scope + b"\x00" + (salt or "").encode(), digest_size=16).digest()


def chain_keys(ids: Sequence[int], root: bytes, block_tokens: int = BLOCK_TOKENS, start: int = 0) -> Iterator[bytes]:
    """The keys of a prompt's full blocks that a cache may serve, in order (a lookup stops hashing
    at its first miss): never the block holding its last token, which the sequence must feed to
    sample after it. From block `start` on, `root` being the key of the block before it."""
    parent = root
    for i in range(start, max(len(ids) - 1, 0) // block_tokens):
        parent = block_key(parent, ids[i * block_tokens : (i + 1) * block_tokens])
        yield parent
