"""The whole train-drafter pipeline on a tiny budget (what CI can afford): self-distil → features
→ train → held-out evaluation → card; each trained drafter beats the same network untrained on
its own held-out split, loads through the factory, and stays lossless."""

import pytest
import torch
from pydantic import ValidationError

from backends.speculative.engine import SpeculativeEngine
from backends.speculative.factory import build_drafter
from backends.speculative.trained import DrafterCard
from backends.training.prompts import CATEGORIES, held_out_topic, training_prompts
from backends.training.train import (
    TrainConfig,
    choose_draft_vocab,
    coverage,
    pick_prompts,
    render_card,
    train_drafter,
)
from policies.drafters import TRAINED_KINDS, DrafterConfig
from router.cli import main

from ..conftest import PROMPTS

# One worker runs the module: its fixture trains three drafters, which two workers would each train.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("training")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("train-drafter")


def _config(kind: str, workdir, **overrides) -> TrainConfig:
    settings = dict(
        kind=kind,
        minutes=0.3,
        prompts=40,
        max_new_tokens=24,
        draft_vocab=4096,
        eval_every=6,
        patience=3,
        alpha_prompts=2,
        alpha_tokens=24,
        out=workdir / "out",
        data_root=workdir / "data",
    )
    return TrainConfig(**{**settings, **overrides})


# EAGLE's steps are the slowest: on a loaded machine its 18-second budget held 6 of them, too few to
# beat the untrained head, so it trains a fixed number of steps within a budget that holds them.
STEPS = {"eagle": {"minutes": 1.0, "max_steps": 14}}


@pytest.fixture(scope="module")
def trained(loaded, costs, workdir):
    """All three kinds on one shared self-distillation cache (generated once, by the first), their
    held-out α runs on the session's step-cost table."""
    lines: list[str] = []
    return {
        kind: train_drafter(
            _config(kind, workdir, **STEPS.get(kind, {})), loaded, progress=False, log=lines.append, costs=costs
        )
        for kind in TRAINED_KINDS
    }


@pytest.mark.parametrize("kind", TRAINED_KINDS)
def test_training_beats_the_untrained_drafter_on_held_out_topics(trained, kind):
    path, card = trained[kind]
    held = card.held_out
    assert held.top1_by_position[0] > held.untrained_top1 + 0.05, render_card(card)
    assert set(held.alpha_by_category) == set(CATEGORIES) and held.alpha_k == 4
    assert all(0.0 <= a <= 1.0 for a in held.alpha_by_category.values())
    assert 0.5 < held.coverage <= 1.0
    assert card.data["train"]["topics"] > card.data["held_out"]["topics"] > 0
    assert card.training["steps"] > 0 and card.training["seconds"] > 0
    assert path.exists() and path.stat().st_size < 12 * 2**20


@pytest.mark.parametrize("kind", TRAINED_KINDS)
def test_the_card_on_disk_is_what_training_returned(trained, kind):
    path, card = trained[kind]
    assert DrafterCard.model_validate_json(path.with_suffix(".json").read_text()) == card
    assert card.kind == kind and card.vocab_size == 49152
    text = render_card(card)
    assert f"draft vocabulary {card.draft_vocab_size:,} of 49,152" in text
    assert f"held-out top-1 by draft position: {card.held_out.top1_by_position[0]:.3f}" in text
    assert f"coverage of held-out target tokens: {card.held_out.coverage:.1%}" in text
    alphas = ", ".join(f"{c} {a:.2f}" for c, a in card.held_out.alpha_by_category.items())
    assert f"held-out α at k = 4 (greedy speculative runs): {alphas}" in text


@pytest.mark.parametrize("kind", TRAINED_KINDS)
def test_a_freshly_trained_drafter_is_lossless(loaded, costs, plain_outputs, trained, kind):
    path, card = trained[kind]
    drafter = build_drafter(DrafterConfig(kind=card.kind, weights=str(path.parent)), loaded)
    engine = SpeculativeEngine(loaded, drafter, k=3, costs=costs)
    chosen = [1, 3, 5]
    results = engine.generate([PROMPTS[i] for i in chosen])
    assert [r.token_ids for r in results] == [plain_outputs[i] for i in chosen]  # each as decoded alone


def test_the_self_distillation_cache_is_reused(loaded, trained, workdir, monkeypatch):
    """A second run finds answers and features cached: nothing is generated or extracted again."""
    monkeypatch.setattr("backends.training.data.PlainEngine.generate", lambda *a: pytest.fail("regenerated"))
    monkeypatch.setattr("backends.training.train.extract_features", lambda *a, **k: pytest.fail("re-extracted"))
    _, card = train_drafter(
        _config("medusa", workdir, minutes=0.05, alpha_prompts=0, out=workdir / "again"),
        loaded,
        progress=False,
        log=lambda _: None,
    )
    assert card.held_out.alpha_by_category == {}


def test_prompt_subsets_keep_every_category_on_both_sides_of_the_split():
    picked = pick_prompts(training_prompts(), 40, seed=0)
    assert 30 <= len(picked) <= 50
    for category in CATEGORIES:
        sides = {held_out_topic(p.category, p.topic) for p in picked if p.category == category}
        assert sides == {True, False}


def test_the_draft_vocabulary_is_the_targets_most_frequent_answer_choices():
    choices = [torch.tensor([9, 9, 5, 5, 5, 7, 1]), torch.tensor([8, 5, 7, 7, 2])]
    ids = choose_draft_vocab(choices, [2, 1], size=3, vocab=10, always=[0])
    # answer positions: c[p-1:-1] → [9, 5, 5, 5, 7] and [8, 5, 7, 7]: 5 and 7 are the most frequent
    assert ids.tolist() == [0, 5, 7]
    assert coverage(choices, [2, 1], ids) == pytest.approx(7 / 9)
    assert choose_draft_vocab(choices, [2, 1], size=0, vocab=10, always=[]).tolist() == list(range(10))


def test_bad_settings_are_refused_before_any_work(loaded, workdir):
    with pytest.raises(ValidationError, match="kind"):
        TrainConfig(kind="lookahead")
    with pytest.raises(ValueError, match="exit_layer must be between 1 and 29"):
        train_drafter(_config("early-exit-adapter", workdir, exit_layer=30), loaded, progress=False, log=lambda _: None)
    with pytest.raises(ValidationError, match="early-exit-adapter"):  # the untrained early exit has nothing to train
        TrainConfig(kind="early-exit")


def test_the_cli_reports_bad_flags_with_exit_code_2(capsys):
    assert main(["train-drafter", "--kind", "medusa", "--minutes", "0"]) == 2
    assert "minutes" in capsys.readouterr().err


def test_the_cli_offers_exactly_the_trained_kinds(capsys):
    with pytest.raises(SystemExit):
        main(["train-drafter", "--kind", "early-exit"])
    err = capsys.readouterr().err
    assert "invalid choice: 'early-exit'" in err and all(kind in err for kind in TRAINED_KINDS)
