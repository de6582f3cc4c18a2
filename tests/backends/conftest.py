"""Tiny randomly initialised Llama models with a small byte-level BPE vocabulary trained in the test
session (the embedded tokenizer's special tokens and chat template): fast enough for thousands of
sampled generations, real enough to exercise every code path."""

import copy

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from backends.generation import GenerationRequest
from backends.models import LoadedModel, describe
from backends.plain import PlainEngine
from backends.scheduler import step_costs
from backends.speculative.control import StepCosts
from backends.speculative.drafters import NgramDrafter, Proposal, build_ngram
from policies.drafters import DrafterConfig
from profiler.workloads import load_prompt_set

# The tiny models' vocabulary: the 256 bytes, the special tokens and merges learnt from the prompt
# set. Their every vocabulary-wide operation (LM head, softmax, q and p, residuals, the CDF a token
# is drawn from) then costs a hundredth of the embedded model's 49,152 tokens, which dominated the
# χ² tests' time; what the tests check does not depend on the vocabulary's size.
TINY_VOCAB = 512


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


def small_tokenizer(like: PreTrainedTokenizerBase, size: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `size` tokens learnt from the prompt set, with `like`'s special tokens
    (at the same ids, first) and chat template: chats and stop tokens work as with `like`."""
    specials = [token.content for _, token in sorted(like.added_tokens_decoder.items()) if token.special]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [m.content for c in load_prompt_set().categories.values() for p in c.prompts for m in p.messages]
    bpe.train_from_iterator(texts, trainer)
    named = {name: getattr(like, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        chat_template=like.chat_template,
        **{name: token for name, token in named.items() if token is not None},
    )


# The real-model engine tests' prompts: copying and free text, chat and raw, of different lengths.
COPY_TEXT = (
    "The Riverside library will close on March 3 for renovations. The children's room moves to the "
    "community hall on Elm Street, and returns are accepted at the front desk of the town office."
)


def chat_request(text: str, max_tokens: int = 24, system: str | None = None, **kwargs) -> GenerationRequest:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return GenerationRequest(messages=messages, max_tokens=max_tokens, **kwargs)


PROMPTS = [
    chat_request(f"Repeat this text exactly: {COPY_TEXT}"),
    GenerationRequest(prompt="def fibonacci(n):", max_tokens=24),
    GenerationRequest(prompt="1, 2, 3, 4, 5,", max_tokens=24),
    chat_request("What is the capital of France?"),
    GenerationRequest(prompt="Once upon a time in a land far away, there lived a", max_tokens=24),
    chat_request("Give me one tip for sleeping better.", system="You are a concise assistant."),
    GenerationRequest(prompt="The chemical symbol for gold is", max_tokens=24),
    chat_request(f"Summarize in one sentence, reusing its words: {COPY_TEXT}"),
]


@pytest.fixture(scope="session")
def plain_outputs(engine: PlainEngine) -> list[list[int]]:
    """The plain engine's greedy tokens for each of PROMPTS decoded alone: what every real-model
    speculative test must reproduce (read once a session)."""
    return [engine.generate([r])[0].token_ids for r in PROMPTS]


@pytest.fixture(scope="session")
def costs(loaded) -> StepCosts:
    """The embedded model's step-cost table for loops up to k_max 8, probed once a session (each
    batch bucket on first use) and shared by the real-model loops of these tests: the table depends
    only on the target, and greedy tokens never depend on it. (Each probe of a bucket at nine widths
    took 3-13 s here; every engine probing its own took a minute of the suite.)"""
    return step_costs(loaded, max_width=9)


@pytest.fixture(scope="session")
def tiny_tokenizer(tokenizer) -> PreTrainedTokenizerFast:
    return small_tokenizer(tokenizer)


@pytest.fixture(scope="session")
def vocab_size(tiny_tokenizer) -> int:
    return len(tiny_tokenizer)  # the tiny models' LM head has a row per token


@pytest.fixture(scope="session")
def tiny_target(tiny_tokenizer, vocab_size) -> LoadedModel:
    return as_loaded(tiny_model(vocab_size, seed=1, sharpness=40.0), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_target_bf16(tiny_tokenizer, vocab_size) -> LoadedModel:
    """The tiny target in bfloat16: its passes are tiled (width-invariant) as the embedded model's are."""
    model = tiny_model(vocab_size, seed=1, sharpness=40.0).to(torch.bfloat16)
    return LoadedModel(model, tiny_tokenizer, describe(model, "tiny-test-llama", "bfloat16", "cpu"))
