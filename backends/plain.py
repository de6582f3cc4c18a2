"""Batched autoregressive decoding with transformers' own KV cache: the plain engine, and the
reference every other engine must match token for token (the step loop in `backends.scheduler`
serves; this one stays as simple as decoding gets).

A batch mixes prompt lengths (left padding, attention mask, explicit position ids), and every
request keeps its own max_tokens, stop strings, sampling settings and seed. Finished sequences
leave the batch: their rows are dropped from the cache, so the remaining ones stop paying for
them. Prompt encoding, EOS ids and the context check live here and every engine shares them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from .errors import RequestError
from .generation import GenerationRequest, GenerationResult, SequenceState, TokenListener, listener_for
from .models import LoadedModel
from .sampling import new_generator, sample_tokens


class PlainEngine:
    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.vocab = len(loaded.tokenizer)  # what a request's own prompt_ids are checked against
        self.info = loaded.info
        self.device = next(self.model.parameters()).device
        self.eos_ids = eos_token_ids(loaded)
        self.context_length = getattr(self.model.config, "max_position_embeddings", None)

    def encode(self, request: GenerationRequest) -> list[int]:
        """Prompt token ids, checked against the vocabulary and the context length."""
        ids = prompt_ids(self.tokenizer, request)
        if request.prompt_ids is not None and not all(0 <= t < self.vocab for t in request.prompt_ids):
            raise RequestError(f"prompt_ids must be token ids of this model's vocabulary (0…{self.vocab - 1})")
        self._check_context(len(ids), request.max_tokens)
        return ids

    @torch.inference_mode()
    def generate(
        self, requests: Sequence[GenerationRequest], listeners: Sequence[TokenListener | None] | None = None
    ) -> list[GenerationResult]:
        """Decode a batch to completion; `listeners[i]` (optional) hears request i's tokens as they come."""
        if not requests:
            return []
        sequences, generators = self._start(requests, listeners)
        input_ids, mask = left_pad([s.prompt_ids for s in sequences], self.tokenizer.pad_token_id, self.device)
        positions = position_ids(mask)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, mask, positions, cache)
        active = list(range(len(sequences)))
        while True:
            params = [sequences[i].request.sampling for i in active]
            tokens = sample_tokens(logits, params, [generators[i] for i in active])
            keep = [
                row
                for row, (i, token) in enumerate(zip(active, tokens.tolist(), strict=True))
                if not sequences[i].append(token, self.tokenizer)
            ]
            if not keep:
                break
            if len(keep) < len(active):
                mask, positions, tokens = drop_finished_rows(cache, keep, mask, positions, tokens)
                active = [active[row] for row in keep]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            positions = positions[:, -1:] + 1
            logits = self._forward(tokens.unsqueeze(1), mask, positions, cache)
        return [s.result(self.tokenizer) for s in sequences]

    def _start(
        self, requests: Sequence[GenerationRequest], listeners: Sequence[TokenListener | None] | None
    ) -> tuple[list[SequenceState], list[torch.Generator]]:
        started_at = time.perf_counter()
        sequences, generators = [], []
        for i, request in enumerate(requests):
            generator, seed = new_generator(request.sampling.seed)
            generators.append(generator)
            listener = listener_for(listeners, i, len(requests))
            state = SequenceState(request, self.encode(request), self.eos_ids, seed, started_at, listener=listener)
            sequences.append(state)
        return sequences, generators

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """Logits of the last position of each row, (B, V); the cache grows by the input length."""
        # Without padding the mask says nothing the causal mask does not: skip building it each step.
        attention_mask = None if bool(mask.all()) else mask
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache, logits_to_keep=1
        )
        return out.logits[:, -1]

    def _check_context(self, prompt_tokens: int, max_tokens: int) -> None:
        if self.context_length and prompt_tokens + max_tokens > self.context_length:
            raise RequestError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                f"of {self.context_length} tokens: shorten the prompt or lower max_tokens"
            )


def eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the generation config's."""
    ids = {loaded.tokenizer.eos_token_id}
    configured = getattr(loaded.model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts to one length so every row's next token sits in the last column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return input_ids, mask


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so padding does not shift a row's rotary phases."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


def drop_finished_rows(
    cache: DynamicCache, keep: list[int], mask: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep only the `keep` rows everywhere; trim padding columns no remaining row needs."""
    index = torch.tensor(keep, device=mask.device)
    cache.batch_select_indices(index)
    mask, positions, tokens = mask[index], positions[index], tokens[index]
    first_used = int(mask.any(dim=0).nonzero()[0])
    # Sliding-window and linear-attention layers keep extra state a column slice would desync.
    plain_layers = all(type(layer) is DynamicLayer for layer in cache.layers)
    if first_used > 0 and plain_layers:
        # A long prompt that finished leaves left padding every other row would keep attending over.
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, first_used:]
            layer.values = layer.values[:, :, first_used:]
        mask = mask[:, first_used:]
    return mask, positions, tokens


def prompt_ids(tokenizer: PreTrainedTokenizerBase, request: GenerationRequest) -> list[int]:
    """A request's prompt tokens (chat messages go through the tokenizer's chat template), followed
    by any tokens an interrupted attempt already generated; the ids the router already computed, if
    it sent them."""
    if request.prompt_ids is not None:
        return request.prompt_ids + request.resume_ids
    if request.messages is not None:
        text = tokenizer.apply_chat_template(
            [m.model_dump() for m in request.messages], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False).input_ids + request.resume_ids
    return tokenizer(request.prompt).input_ids + request.resume_ids
