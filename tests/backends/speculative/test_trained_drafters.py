"""Trained drafters (EAGLE, Medusa, early-exit adapter) behind the drafter interface: the shipped
ones are lossless in greedy decoding (fp32), EAGLE's q keeps sampling exact (χ²), and a drafter
trained for another target is refused."""

import pytest
import torch

from backends.errors import ModelLoadError
from backends.generation import GenerationRequest
from backends.models import load_model
from backends.plain import PlainEngine
from backends.sampling import SamplingParams
from backends.speculative.engine import SpeculativeEngine
from backends.speculative.factory import build_drafter
from backends.speculative.trained import (
    DEFAULTS_DIR,
    DrafterCard,
    DraftVocab,
    EagleNet,
    HeldOut,
    TrainedDrafter,
    default_weights,
    load_drafter,
)
from backends.speculative.trained_drafters import EagleDrafter, MedusaDrafter
from backends.training.data import Sample, extract_features
from backends.training.loops import EagleTask
from backends.training.train import TrainConfig, choose_draft_vocab, fit, to_sequences
from policies.drafters import DrafterConfig

from ..conftest import PROMPTS
from .test_engine import _exact_joint, _matches_target, _sample_pairs

pytestmark = pytest.mark.slow

TRAINED = ["eagle", "medusa", "early-exit-adapter"]


@pytest.fixture(scope="module")
def shipped(loaded):
    return {kind: build_drafter(DrafterConfig(kind=kind), loaded) for kind in TRAINED}


@pytest.mark.parametrize("k", [2, "auto"])
@pytest.mark.parametrize("kind", TRAINED)
def test_greedy_mixed_batch_is_token_identical_to_plain(loaded, costs, plain_outputs, shipped, kind, k):
    engine = SpeculativeEngine(loaded, shipped[kind].fresh(), k=k, costs=costs)
    results = engine.generate(PROMPTS)
    assert [r.token_ids for r in results] == plain_outputs
    if k != "auto":  # auto k follows measured timings and may rightly decline to draft on a busy machine
        assert engine.totals.accepted_tokens > 0  # trained drafters do get tokens accepted


@pytest.mark.parametrize("kind", TRAINED)
def test_greedy_batch_of_one_is_token_identical_to_plain(loaded, costs, plain_outputs, shipped, kind):
    engine = SpeculativeEngine(loaded, shipped[kind].fresh(), k=4, costs=costs)
    for i in [0, 3, 5]:
        assert engine.generate([PROMPTS[i]])[0].token_ids == plain_outputs[i], f"prompt {i}"


def test_medusa_never_drafts_more_tokens_than_it_has_heads(loaded, costs, shipped):
    drafter = shipped["medusa"].fresh()
    assert isinstance(drafter, MedusaDrafter)
    engine = SpeculativeEngine(loaded, drafter, k=8, costs=costs)
    result = engine.generate([PROMPTS[3]])[0]
    assert result.speculation is not None
    assert 0 < max(result.speculation.k_history) <= len(drafter.net.heads)


@pytest.mark.parametrize("kind", TRAINED)
def test_shipped_drafters_are_small_carry_a_card_and_fit_the_embedded_target(loaded, kind):
    path = default_weights(kind, loaded.info.name)
    assert path.parent.parent == DEFAULTS_DIR
    assert path.stat().st_size < 12 * 2**20
    card = DrafterCard.model_validate_json(path.with_suffix(".json").read_text())
    assert card.kind == kind and card.fingerprint == loaded.fingerprint
    assert card.held_out.top1_by_position[0] > card.held_out.untrained_top1
    assert set(card.held_out.alpha_by_category) == {"chat", "code", "math", "qa"}
    assert 0.9 < card.held_out.coverage <= 1.0
    assert card.data["train"]["answer_tokens"] > 50_000 and card.command.startswith("specroute train-drafter")


def test_the_fingerprint_ignores_dtype_but_not_the_weights(loaded, tiny_target):
    bf16 = load_model("embedded", dtype="bfloat16")
    assert bf16.fingerprint == loaded.fingerprint
    assert tiny_target.fingerprint != loaded.fingerprint


@pytest.mark.parametrize("kind", TRAINED)
def test_a_drafter_trained_for_another_target_is_refused(loaded, tiny_target, kind):
    path = default_weights(kind, loaded.info.name)
    with pytest.raises(ModelLoadError, match="trained for another target.*train-drafter"):
        load_drafter(path, tiny_target.model, tiny_target.tokenizer, torch.float32)


def test_unknown_weights_paths_are_refused_with_the_fix(loaded, tmp_path):
    with pytest.raises(ModelLoadError, match="no trained eagle drafter"):
        build_drafter(DrafterConfig(kind="eagle", weights=str(tmp_path)), loaded)
    card = tmp_path / "medusa.json"
    (tmp_path / "medusa.safetensors").write_bytes(b"")
    card.write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read the drafter card"):
        build_drafter(DrafterConfig(kind="medusa", weights=str(tmp_path)), loaded)


SAMPLING = SamplingParams(temperature=1.0, top_k=6)


@pytest.fixture(scope="module")
def tiny_eagle(tiny_target) -> TrainedDrafter:
    """An EAGLE head for the tiny target, self-distilled from its sampled outputs and trained for a
    few seconds: it agrees with the target often enough for both accept and reject paths."""
    target = tiny_target
    engine = PlainEngine(target)
    # Mostly the prompts the χ² test samples after, so a few seconds of training reach them.
    prompts = ["Once upon a time"] * 96 + ["A much longer prompt about a completely different topic, namely"] * 32
    prompts += [f"Story number {i}: the" for i in range(32)]
    requests = [
        GenerationRequest(prompt=p, max_tokens=8, ignore_eos=True, sampling=SAMPLING.model_copy(update={"seed": i}))
        for i, p in enumerate(prompts)
    ]
    results = engine.generate(requests)
    samples = [
        Sample(f"s{i}", "chat", f"t{i}", engine.encode(r), res.token_ids)
        for i, (r, res) in enumerate(zip(requests, results, strict=True))
    ]
    layers = [target.model.config.num_hidden_layers]
    features, choices = extract_features(target, samples, layers, progress=False)
    vocab = target.model.config.vocab_size
    ids = choose_draft_vocab(choices, [len(s.prompt_ids) for s in samples], 1024, vocab, [])  # q is 0 outside
    data = to_sequences(samples, features, choices, ids, vocab)
    head = DraftVocab(target.model.get_output_embeddings().weight, ids, torch.float32)
    net = EagleNet(target.model.config, 64)
    net.attach(target.model.get_input_embeddings(), head)
    config = TrainConfig(kind="eagle", minutes=3, max_steps=80, eval_every=60, batch_tokens=1024, patience=100, lr=3e-3)
    fit(EagleTask(net, head), data, data, config, progress=False)
    card = DrafterCard(
        kind="eagle",
        target="tiny",
        fingerprint=target.fingerprint,
        vocab_size=vocab,
        hidden_size=target.model.config.hidden_size,
        draft_vocab_size=len(ids),
        layers=layers,
        width=64,
        parameters=sum(p.numel() for p in net.parameters()),
        held_out=HeldOut(top1_by_position=[0.0], coverage=1.0, untrained_top1=0.0),
    )
    return TrainedDrafter(card, net.requires_grad_(False), head)


def test_sampling_with_eagles_q_follows_the_targets_distribution(tiny_target, tiny_eagle):
    drafter = EagleDrafter(tiny_eagle)
    engine = SpeculativeEngine(tiny_target, drafter, k=2)
    prompt, other = "Once upon a time", "A much longer prompt about a completely different topic, namely"
    samples = _sample_pairs(engine, prompt, other, batches=400)
    joint = _exact_joint(tiny_target, tiny_target.tokenizer(prompt).input_ids, SAMPLING)
    assert engine.totals.accepted_tokens > 0.05 * engine.totals.draft_tokens  # both paths are exercised
    assert engine.totals.accepted_tokens < 0.95 * engine.totals.draft_tokens
    assert _matches_target(samples, joint)


def test_tiny_eagle_is_lossless_in_a_mixed_greedy_batch(tiny_target, tiny_eagle):
    """Rows of different lengths that finish at different steps: the features the engine reports
    stay aligned with each row's tokens (the drafter asserts it) and the output is the target's."""
    drafter = EagleDrafter(tiny_eagle)
    engine = SpeculativeEngine(tiny_target, drafter, k=3)
    requests = [
        GenerationRequest(prompt="Once upon a time", max_tokens=20, ignore_eos=True),
        GenerationRequest(prompt="Story number 3: the", max_tokens=7, ignore_eos=True),
        GenerationRequest(prompt="A much longer prompt about a completely different topic, namely", max_tokens=13),
    ]
    plain = PlainEngine(tiny_target).generate(requests)
    assert [r.token_ids for r in engine.generate(requests)] == [r.token_ids for r in plain]
    assert engine.totals.accepted_tokens > 0
