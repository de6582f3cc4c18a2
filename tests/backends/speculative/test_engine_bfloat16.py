"""In bfloat16 speculation stays lossless through width-invariant passes: for every drafter, greedy
output is token-identical to the plain step loop's (the plain backend's) at batch 1, on prompts of
every category; sampling keeps the target's distribution with tiles on (χ² on tiny models)."""

import pytest

from backends.generation import GenerationRequest
from backends.scheduler import LoopSettings, Scheduler
from backends.speculative.drafters import ModelDrafter
from backends.speculative.engine import SpeculativeEngine, step_costs
from backends.speculative.factory import build_drafter
from policies.drafters import DrafterConfig
from profiler.workloads import load_prompt_set

from ..conftest import perturbed, tiny_model
from .test_engine import SAMPLING, _exact_joint, _matches_target, _sample_pairs

pytestmark = pytest.mark.slow


def _requests(per_category: int, max_tokens: int) -> list[GenerationRequest]:
    categories = load_prompt_set("project").categories.values()
    return [
        GenerationRequest(messages=p.messages, max_tokens=max_tokens)
        for category in categories
        for p in category.prompts[:per_category]
    ]


REQUESTS = _requests(per_category=2, max_tokens=24)  # 14 prompts, 7 categories
SPREAD = REQUESTS[::2]  # one per category, for the drafters that cost a model pass per draft


@pytest.fixture(scope="module")
def plain_bf16(loaded_bf16):
    loop = Scheduler(loaded_bf16)
    assert loop.tile == 9  # width-invariant by default in bfloat16
    return [loop.generate([r])[0].token_ids for r in REQUESTS]


@pytest.fixture(scope="module")
def costs_bf16(loaded_bf16):
    return step_costs(loaded_bf16, max_width=9)


def _drafter(kind: str, loaded):
    if kind == "model":  # a tiny random model: nearly every draft is rejected, so every step rolls back
        return ModelDrafter(tiny_model(loaded.model.config.vocab_size, seed=5), loaded.model.config.vocab_size)
    return build_drafter(DrafterConfig(kind=kind), loaded)


@pytest.mark.parametrize("k", [8, "auto"])
def test_prompt_lookup_in_bfloat16_is_token_identical_to_plain_on_every_prompt(loaded_bf16, plain_bf16, costs_bf16, k):
    engine = SpeculativeEngine(loaded_bf16, _drafter("ngram", loaded_bf16), k=k, costs=costs_bf16)
    outputs = [engine.generate([r])[0].token_ids for r in REQUESTS]
    assert engine.totals.accepted_tokens > 0  # drafts were verified in blocks, not just plain steps
    mismatched = [i for i, (a, b) in enumerate(zip(outputs, plain_bf16, strict=True)) if a != b]
    assert mismatched == []


@pytest.mark.parametrize("kind", ["model", "early-exit", "eagle", "medusa", "early-exit-adapter"])
def test_every_drafter_in_bfloat16_is_token_identical_to_plain(loaded_bf16, plain_bf16, costs_bf16, kind):
    engine = SpeculativeEngine(loaded_bf16, _drafter(kind, loaded_bf16), k=4, costs=costs_bf16)
    outputs = [engine.generate([r])[0].token_ids for r in SPREAD]
    assert engine.totals.draft_tokens > 0
    assert outputs == plain_bf16[::2]


def test_sampling_through_width_invariant_passes_keeps_the_targets_distribution(tiny_target):

    draft = perturbed(tiny_target.model, noise=0.4, seed=9)
    settings = LoopSettings(width_invariant="on", tile_width=4)
    engine = SpeculativeEngine(
        tiny_target, ModelDrafter(draft, tiny_target.model.config.vocab_size), k=3, settings=settings
    )
    assert engine.tile == 4
    prompt, other = "Once upon a time", "A much longer prompt about a completely different topic, namely"
    samples = _sample_pairs(engine, prompt, other, batches=400)
    joint = _exact_joint(tiny_target, tiny_target.tokenizer(prompt).input_ids, SAMPLING)
    assert engine.totals.accepted_tokens > 0.1 * engine.totals.draft_tokens
    assert _matches_target(samples, joint)
