"""In bfloat16 speculation stays lossless through width-invariant passes: for every drafter, greedy
output is token-identical to the plain step loop's (the plain backend's) at batch 1, on prompts of
every category; sampling keeps the target's distribution with tiles on (χ² on tiny models).

Tiling is what makes it exact, whatever the model: every drafter and k runs on the tiny bfloat16
target everywhere; the embedded model in bfloat16 runs where this CPU has bfloat16 arithmetic (where
it does not, bfloat16 is never served and each of its passes is emulated)."""

import pytest

from backends.generation import GenerationRequest
from backends.scheduler import LoopSettings, Scheduler
from backends.speculative.control import DraftCosts
from backends.speculative.drafters import ModelDrafter
from backends.speculative.engine import SpeculativeEngine, step_costs
from backends.speculative.factory import build_drafter
from policies.drafters import DrafterConfig
from profiler.workloads import load_prompt_set

from ...conftest import NATIVE_BF16_ONLY
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


@pytest.fixture(scope="module", params=["tiny", pytest.param("embedded", marks=NATIVE_BF16_ONLY)])
def bf16_target(request):
    """A bfloat16 target, its plain step loop's greedy tokens for every request and its step costs."""
    target = request.getfixturevalue("tiny_target_bf16" if request.param == "tiny" else "loaded_bf16")
    loop = Scheduler(target)
    assert loop.tile == 9  # width-invariant by default in bfloat16
    return target, [loop.generate([r])[0].token_ids for r in REQUESTS], step_costs(target, max_width=9)


def _drafter(kind: str, loaded):
    if kind == "agreeing-model":  # the target plus noise: most drafts accepted, some rejected mid-block
        return ModelDrafter(perturbed(loaded.model, noise=0.4, seed=9), loaded.model.config.vocab_size)
    if kind == "model":  # a tiny random model: nearly every draft is rejected, so every step rolls back
        return ModelDrafter(tiny_model(loaded.model.config.vocab_size, seed=5), loaded.model.config.vocab_size)
    if kind == "early-exit":
        return build_drafter(DrafterConfig(kind=kind, exit_layer=min(4, loaded.info.layers - 1)), loaded)
    return build_drafter(DrafterConfig(kind=kind), loaded)


@pytest.mark.parametrize("k", [8, "auto"])
def test_drafts_verified_in_bfloat16_blocks_are_token_identical_to_plain_on_every_prompt(
    tiny_target_bf16, monkeypatch, k
):
    """The tiny target with a drafter that mostly agrees (prompt lookup finds nothing to copy in a
    random model's output): blocks accepted whole and in part, every prompt alone. Drafting is priced
    as nearly free, as prompt lookup is, so auto k drafts too (a tiny drafter costs a tiny target's step)."""
    monkeypatch.setattr(DraftCosts, "record", lambda *args, **kwargs: None)
    loop = Scheduler(tiny_target_bf16)
    plain = [loop.generate([r])[0].token_ids for r in REQUESTS]
    drafter = _drafter("agreeing-model", tiny_target_bf16)
    engine = SpeculativeEngine(tiny_target_bf16, drafter, k=k)
    engine.drafter_costs[drafter.name] = DraftCosts(step_s={b: 1e-5 for b in (1, 2, 4, 8)})
    outputs = [engine.generate([r])[0].token_ids for r in REQUESTS]
    assert 0 < engine.totals.accepted_tokens < engine.totals.draft_tokens
    assert [i for i, (a, b) in enumerate(zip(outputs, plain, strict=True)) if a != b] == []


@NATIVE_BF16_ONLY
@pytest.mark.parametrize("k", [8, "auto"])
def test_prompt_lookup_in_bfloat16_is_token_identical_to_plain_on_every_prompt(loaded_bf16, k):
    loop = Scheduler(loaded_bf16)
    plain = [loop.generate([r])[0].token_ids for r in REQUESTS]
    engine = SpeculativeEngine(loaded_bf16, _drafter("ngram", loaded_bf16), k=k, costs=step_costs(loaded_bf16, 9))
    outputs = [engine.generate([r])[0].token_ids for r in REQUESTS]
    assert engine.totals.accepted_tokens > 0  # drafts were verified in blocks, not just plain steps
    mismatched = [i for i, (a, b) in enumerate(zip(outputs, plain, strict=True)) if a != b]
    assert mismatched == []


@pytest.mark.parametrize("kind", ["model", "early-exit"])
def test_every_drafter_in_bfloat16_is_token_identical_to_plain(bf16_target, kind):
    target, plain, costs = bf16_target
    engine = SpeculativeEngine(target, _drafter(kind, target), k=4, costs=costs)
    outputs = [engine.generate([r])[0].token_ids for r in SPREAD]
    assert engine.totals.draft_tokens > 0
    assert outputs == plain[::2]


@pytest.fixture(scope="module")
def embedded_bf16_spread(loaded_bf16):
    """The embedded model's plain greedy tokens for SPREAD in bfloat16, and its step costs."""
    loop = Scheduler(loaded_bf16)
    return [loop.generate([r])[0].token_ids for r in SPREAD], step_costs(loaded_bf16, max_width=9)


@NATIVE_BF16_ONLY
@pytest.mark.parametrize("kind", ["eagle", "medusa", "early-exit-adapter"])
def test_every_trained_drafter_in_bfloat16_is_token_identical_to_plain(loaded_bf16, embedded_bf16_spread, kind):
    """The trained drafters are trained for the embedded model: they draft for it alone."""
    plain, costs = embedded_bf16_spread
    engine = SpeculativeEngine(loaded_bf16, _drafter(kind, loaded_bf16), k=4, costs=costs)
    outputs = [engine.generate([r])[0].token_ids for r in SPREAD]
    assert engine.totals.draft_tokens > 0
    assert outputs == plain


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
