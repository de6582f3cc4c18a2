"""Tiny randomly initialised Llama models with the embedded model's tokenizer and vocabulary:
fast enough for thousands of sampled generations, real enough to exercise every code path."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.models import LoadedModel, describe
from backends.speculative.drafters import NgramDrafter, Proposal, build_ngram
from policies.drafters import DrafterConfig


def tiny_model(vocab_size: int, seed: int, sharpness: float = 1.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random logits are nearly flat; sharpen them so distributions have shape
        model.lm_head.weight.mul_(sharpness)
    return model


def lookup(**options) -> NgramDrafter:
    """Prompt lookup as the registry builds and names it ('ngram'); it reads no target."""
    drafter = build_ngram(DrafterConfig(kind="ngram", **options), None)
    assert isinstance(drafter, NgramDrafter)
    return drafter


class BrokenDrafter(NgramDrafter):
    """Prompt lookup that fails in one of its calls (`where`): propose, observe or release. Its
    rows must end with their own error, no one else's."""

    name = "broken"

    def __init__(self, where: str = "propose"):
        super().__init__()
        self.where = where

    def propose(self, rows, ks, judge=None) -> Proposal:
        self._break("propose")
        return super().propose(rows, ks, judge)

    def observe(self, rows, accepted) -> None:
        self._break("observe")
        super().observe(rows, accepted)

    def release(self, key: int) -> None:
        self._break("release")
        super().release(key)

    def fresh(self) -> "BrokenDrafter":
        return BrokenDrafter(self.where)

    def _break(self, call: str) -> None:
        if call == self.where:
            raise RuntimeError("drafter broke")


def perturbed(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """A drafter that mostly agrees with `model`: its weights plus Gaussian noise."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(noise * parameter.std() * torch.randn_like(parameter))
    return draft


def as_loaded(model: LlamaForCausalLM, tokenizer) -> LoadedModel:
    return LoadedModel(model, tokenizer, describe(model, "tiny-test-llama", "float32", "cpu"))


@pytest.fixture(scope="session")
def vocab_size(tokenizer) -> int:
    return len(tokenizer)  # the embedded model's LM head has a row per token


@pytest.fixture(scope="session")
def tiny_target(tokenizer, vocab_size) -> LoadedModel:
    return as_loaded(tiny_model(vocab_size, seed=1, sharpness=40.0), tokenizer)


@pytest.fixture(scope="session")
def tiny_target_bf16(tokenizer, vocab_size) -> LoadedModel:
    """The tiny target in bfloat16: its passes are tiled (width-invariant) as the embedded model's are."""
    model = tiny_model(vocab_size, seed=1, sharpness=40.0).to(torch.bfloat16)
    return LoadedModel(model, tokenizer, describe(model, "tiny-test-llama", "bfloat16", "cpu"))
