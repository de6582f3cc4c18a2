"""The router's estimate of each backend's prefix cache: what it sent where, block by block."""

from policies.prefix import BLOCK_TOKENS
from router.prefix_index import PrefixIndex

PROMPT = list(range(100, 100 + 3 * BLOCK_TOKENS + 5))  # three full blocks and a partial one


def test_a_prompt_sent_to_a_backend_is_expected_cached_there_and_only_there():
    index = PrefixIndex(64, ["speculative", "plain"])
    assert index.cached_tokens("plain", PROMPT) == 0
    index.sent("plain", PROMPT)
    assert index.cached_tokens("plain", PROMPT) == 3 * BLOCK_TOKENS
    assert index.cached_tokens("speculative", PROMPT) == 0
    other_tail = [*PROMPT[: 2 * BLOCK_TOKENS], 7, 8, 9]  # shares two blocks, then differs
    assert index.cached_tokens("plain", other_tail) == 2 * BLOCK_TOKENS
    assert index.cached_tokens("plain", [1, *PROMPT[1:]]) == 0  # a block's key covers every token before it
    # a prompt of exactly whole blocks still feeds its last token: its last block is never counted
    assert index.cached_tokens("plain", PROMPT[: 3 * BLOCK_TOKENS]) == 2 * BLOCK_TOKENS


def test_salts_separate_and_the_least_recently_sent_blocks_go_first():
    index = PrefixIndex(4, ["plain"])
    index.sent("plain", PROMPT, salt="a")
    assert index.cached_tokens("plain", PROMPT) == 0 and index.cached_tokens("plain", PROMPT, "b") == 0
    assert index.cached_tokens("plain", PROMPT, "a") == 3 * BLOCK_TOKENS
    index.sent("plain", list(range(500, 500 + 2 * BLOCK_TOKENS + 1)))  # two more blocks: one of "a"'s goes
    assert index.cached_tokens("plain", PROMPT, "a") == 0  # its first block was the least recently used
    assert PrefixIndex(0, ["plain"]).cached_tokens("plain", PROMPT) == 0
    off = PrefixIndex(0, ["plain"])
    off.sent("plain", PROMPT)
    assert off.cached_tokens("plain", PROMPT) == 0


def test_every_holder_is_answered_from_one_pass_that_stops_at_the_first_block_none_holds(monkeypatch):
    import policies.prefix as prefix

    index = PrefixIndex(64, ["speculative", "plain"])
    index.sent("plain", PROMPT)
    index.sent("speculative", [*PROMPT[:BLOCK_TOKENS], 1, 2, 3])  # holds the first block only
    hashed = []
    real = prefix.block_key
    monkeypatch.setattr(prefix, "block_key", lambda parent, tokens: hashed.append(1) or real(parent, tokens))
    assert index.cached(PROMPT) == {"plain": 3 * BLOCK_TOKENS, "speculative": BLOCK_TOKENS}
    assert len(hashed) == 3
    hashed.clear()
    stranger = [*PROMPT[:BLOCK_TOKENS], *range(900, 900 + 4 * BLOCK_TOKENS)]
    assert index.cached(stranger) == {"plain": BLOCK_TOKENS, "speculative": BLOCK_TOKENS}
    assert len(hashed) == 2  # the second block is nobody's: no further block is hashed
