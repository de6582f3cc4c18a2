"""Speculative decoding: a drafter proposes k tokens, the target verifies them in one pass,
and exact rejection sampling keeps the output distribution the target's own."""
