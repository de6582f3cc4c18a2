"""The engines a user would run instead of specroute, run untouched beside it in the benches: the
numbers specroute's own must be read against."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from backends.engines.llamacpp import llama_unavailable
from backends.errors import ModelLoadError

PEER_CONTEXT = 4096  # tokens of the peer's context: every bench prompt and its answer fit


class LlamaCppPeer:
    """llama.cpp's own generation (`llama_cpp.Llama.generate`, greedy) of a GGUF file, with the
    bindings' defaults but for the thread count: what a CPU user of llama.cpp runs. Every request
    prefills its whole prompt: `generate` would otherwise keep the previous request's cache for the
    prefix the two share (the chat template's system prompt, or the whole prompt when a bench
    repeats it), a prefix cache the step loop does not have yet, so the ratio would time that
    instead of the engines."""

    name = "llama.cpp generate"

    def __init__(self, path: Path, threads: int):
        reason = llama_unavailable()
        if reason is not None:
            raise ModelLoadError(reason)
        import llama_cpp

        self.llama = llama_cpp.Llama(
            str(path), n_ctx=PEER_CONTEXT, n_threads=threads, n_threads_batch=threads, verbose=False
        )

    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids: Collection[int] = ()) -> list[int]:
        """Greedy tokens after `prompt_ids`, up to `max_tokens` or an EOS id (kept, as the step loop
        keeps it); no EOS ids: exactly `max_tokens`."""
        tokens: list[int] = []
        self.llama.reset()  # forget the last request's tokens: no prefix reuse (see the class docstring)
        for token in self.llama.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if token in eos_ids or len(tokens) >= max_tokens:
                break
        return tokens
