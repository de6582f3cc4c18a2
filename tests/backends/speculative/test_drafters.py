import numpy as np
import pytest
import torch

from backends.errors import ModelLoadError
from backends.sampling import SamplingParams
from backends.speculative.drafters import DraftRow, ModelDrafter, NgramDrafter, early_exit_model
from backends.speculative.factory import build_drafter
from backends.training.loops import Task
from policies.drafters import REGISTRY, DrafterConfig, resolve

from ..conftest import tiny_model

GREEDY = SamplingParams()


def _row(prompt: list[int], generated: list[int] | None = None, key: int = 0) -> DraftRow:
    return DraftRow(key, list(prompt), list(generated or []), GREEDY, torch.Generator().manual_seed(0))


def _ngram(rows, ks, **kwargs):
    drafter = NgramDrafter(**kwargs)
    return drafter, drafter.propose(rows, ks).tokens


def test_ngram_proposes_what_followed_the_longest_matching_suffix():
    # suffix [1, 2, 3] occurred once, followed by 7 8 9; the shorter [2, 3] also occurs, followed by 5
    row = _row([2, 3, 5, 1, 2, 3, 7, 8, 9, 4, 1, 2, 3])
    _, tokens = _ngram([row], [3], max_n=3, min_n=2)
    assert tokens == [[7, 8, 9]]


def test_ngram_uses_the_latest_occurrence_and_stops_at_k():
    row = _row([1, 2, 9, 9, 1, 2, 6, 6, 6, 6, 1, 2])
    _, tokens = _ngram([row], [2], max_n=2, min_n=2)
    assert tokens == [[6, 6]]


def test_ngram_with_no_match_proposes_nothing():
    _, tokens = _ngram([_row([1, 2, 3, 4, 5])], [4], max_n=3, min_n=2)
    assert tokens == [[]]


def test_ngram_indexes_generated_tokens_as_they_arrive():
    row = _row([10, 11, 12, 13])
    drafter, tokens = _ngram([row], [3], max_n=2, min_n=1)
    assert tokens == [[]]
    row.token_ids.extend([20, 21, 22, 10, 11])  # the output now repeats the prompt's opening
    assert drafter.propose([row], [3]).tokens == [[12, 13, 20]]


def test_ngram_rows_are_independent_and_finished_rows_leave():
    rows = [_row([1, 2, 3, 1, 2], key=4), _row([5, 6, 5], key=9)]
    drafter, tokens = _ngram(rows, [1, 2], max_n=2, min_n=1)
    assert tokens == [[3], [6, 5]]
    drafter.release(4)
    assert set(drafter.indexes) == {9}
    assert drafter.propose([rows[1]], [1]).tokens == [[6]]


def test_ngram_rejects_an_empty_range():
    with pytest.raises(ValueError):
        NgramDrafter(max_n=1, min_n=2)


def _greedy_continuation(model, tokens: list[int], count: int) -> list[int]:
    """The draft model's own greedy continuation, recomputed from scratch without a cache."""
    tokens = list(tokens)
    with torch.inference_mode():
        for _ in range(count):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[-count:]


def test_model_drafter_rolls_back_to_the_accepted_prefix(tiny_target, vocab_size):
    model = tiny_target.model
    drafter = ModelDrafter(model, target_vocab=vocab_size)
    rows = [_row([5, 6, 7, 8], [9], key=0), _row([30, 31], [32], key=1)]
    first = drafter.propose(rows, [4, 3]).tokens
    assert first == [_greedy_continuation(model, r.context(), k) for r, k in zip(rows, [4, 3], strict=True)]
    # Row 0 accepts 2 drafts then the target emits 77; row 1 accepts none and gets 88.
    drafter.observe(rows, [2, 0])
    rows[0].token_ids.extend(first[0][:2] + [77])
    rows[1].token_ids.append(88)
    second = drafter.propose(rows, [3, 3]).tokens
    assert second == [_greedy_continuation(model, r.context(), 3) for r in rows]


def test_model_drafter_catches_up_rows_that_skipped_steps_or_joined_late(tiny_target, vocab_size):
    model = tiny_target.model
    drafter = ModelDrafter(model, target_vocab=vocab_size)
    early, late = _row([5, 6, 7, 8], [9], key=0), _row([30, 31], [32], key=1)
    assert drafter.backlog(early) == 5  # never seen: its whole context is to read
    drafter.propose([early], [3])
    drafter.observe([early], [1])
    early.token_ids.extend([40, 41, 42, 43])  # plain steps went by without drafting
    assert drafter.backlog(early) == 4
    tokens = drafter.propose([late, early], [2, 3]).tokens  # a sequence it never saw joins
    assert tokens == [_greedy_continuation(model, late.context(), 2), _greedy_continuation(model, early.context(), 3)]
    seqs = {key: state.seq for key, state in drafter.sequences.items()}
    assert drafter.cache.length(seqs[1]) == late.length + 1  # its context + one fed draft
    drafter.release(0)
    assert set(drafter.sequences) == {1} and seqs[0] not in drafter.cache.sequences
    fresh = drafter.fresh()
    assert fresh.model is drafter.model and fresh.cache is None and not fresh.sequences


def test_model_drafter_refuses_a_different_vocabulary(tiny_target):
    other = tiny_model(vocab_size=1000, seed=3)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        ModelDrafter(other, target_vocab=tiny_target.model.config.vocab_size)


def test_early_exit_shares_the_targets_weights_and_leaves_it_whole(tiny_target):
    target = tiny_target.model
    shallow = early_exit_model(target, 1)
    assert len(shallow.model.layers) == 1 and len(target.model.layers) == 2
    assert target.config.num_hidden_layers == 2
    assert shallow.model.layers[0] is target.model.layers[0]
    assert shallow.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert shallow.model.norm is target.model.norm


@pytest.mark.parametrize("layers", [0, 2, 5])
def test_early_exit_refuses_a_layer_count_outside_the_target(tiny_target, layers):
    with pytest.raises(ModelLoadError, match="exit layer"):
        early_exit_model(tiny_target.model, layers)


@pytest.mark.slow
def test_factory_refuses_drafting_with_the_target_itself_in_the_same_dtype(loaded):
    config = DrafterConfig(kind="model", draft_model="embedded", draft_dtype="float32")
    with pytest.raises(ModelLoadError, match="target itself"):
        build_drafter(config, loaded)


@pytest.mark.slow
def test_auto_draft_model_under_a_bfloat16_target_is_the_weight_only_model_its_weights_fit(loaded_bf16):
    # A bfloat16 copy of a bfloat16 target would cost what the target does; the embedded weights sit
    # on a 4-bit grid, so the draft model is the int4 one.
    drafter = build_drafter(DrafterConfig(kind="model", draft_model="embedded"), loaded_bf16)
    assert drafter.name == "model:SmolLM2-135M-Instruct@int4-weight-only"


def test_factory_config_rejects_a_reversed_ngram_range():
    with pytest.raises(ValueError, match="ngram_min"):
        DrafterConfig(ngram_min=5, ngram_max=2)


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.kind)
def test_every_registry_entry_names_code_that_exists(entry):
    """Each kind's builder, and for trained kinds its network and training task, resolve."""
    assert callable(resolve(entry.build))
    if entry.trained:
        network, task = resolve(entry.network), resolve(entry.task)
        assert issubclass(network, torch.nn.Module) and hasattr(network, "from_card")
        assert issubclass(task, Task) and task.create is not Task.create


def test_built_drafters_carry_the_registry_name_through_fresh(tiny_target):
    drafter = build_drafter(DrafterConfig(kind="early-exit", exit_layer=1), tiny_target)
    assert drafter.name == "early-exit-1" and drafter.fresh().name == "early-exit-1"
    lookup = build_drafter(DrafterConfig(kind="ngram"), tiny_target)
    assert lookup.name == "ngram" and lookup.fresh().name == "ngram"


def test_ngram_features_describe_the_match_each_proposal_copies():
    from backends.speculative.acceptance import NGRAM_FEATURES

    # [7, 8] occurred twice before: followed by 9 once, then by 5 (the latest, which is proposed).
    row = _row([1, 7, 8, 9, 2, 3, 7, 8, 5, 6, 4, 3, 7, 8])
    drafter = NgramDrafter(max_n=2, min_n=2)
    proposal = drafter.propose([row], [2])
    assert proposal.tokens == [[5, 6]]
    [features] = proposal.features
    assert features.shape == (2, len(NGRAM_FEATURES))
    named = dict(zip(NGRAM_FEATURES, features[0], strict=True))
    assert named["match"] == pytest.approx(np.log1p(3))  # 3, 7, 8 matches before the copied 5
    assert named["occurrences"] == pytest.approx(np.log1p(2))
    assert named["agreement"] == pytest.approx(0.5)
    assert named["distance"] == pytest.approx(np.log1p(len(row.prompt_ids) - 8))
    assert features[:, -1].tolist() == [0.0, 1.0]  # the position in the draft


def test_a_judge_stops_each_row_of_a_model_drafter_where_it_says():
    model = tiny_model(64, seed=2)
    drafter = ModelDrafter(model, 64)
    rows = [_row([1, 2, 3, 4], key=0), _row([5, 6, 7], key=1)]
    seen = []

    def judge(steps, features):
        seen.append([f.shape[0] for f in features])
        return [steps < 2, True]  # row 0 stops after two tokens, row 1 drafts all it asked for

    proposal = drafter.propose(rows, [5, 4], judge)
    assert [len(t) for t in proposal.tokens] == [2, 4] and [f.shape[0] for f in proposal.features] == [2, 4]
    assert seen[0] == [1, 1] and len(seen) == 3
    unjudged = ModelDrafter(model, 64).propose([_row([1, 2, 3, 4]), _row([5, 6, 7], key=1)], [5, 4])
    assert proposal.tokens[0] == unjudged.tokens[0][:2] and proposal.tokens[1] == unjudged.tokens[1]
    # The next proposal continues from a cache that holds only what was fed.
    rows[0].token_ids.extend(proposal.tokens[0])
    again = drafter.propose(rows[:1], [2])
    fresh = ModelDrafter(model, 64).propose([_row([1, 2, 3, 4, *proposal.tokens[0]])], [2])
    assert again.tokens == fresh.tokens
