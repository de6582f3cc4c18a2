"""Self-distillation data: answers are the target's own greedy output, generation resumes from
its cache, features line up with the tokens and their LM head gives the target's choices."""

import pytest
import torch

from backends.plain import PlainEngine
from backends.training.data import _request, data_dir, extract_features, generate_samples, load_samples
from backends.training.prompts import training_prompts

from ..conftest import as_loaded, tiny_model

pytestmark = pytest.mark.slow


def test_answers_are_the_targets_greedy_output_and_a_rerun_resumes(loaded, tmp_path, monkeypatch):
    prompts = training_prompts()[:3]
    path = tmp_path / "samples.jsonl"
    first = generate_samples(loaded, prompts[:2], path, max_new_tokens=6, batch=2, progress=False)
    calls = []
    original = PlainEngine.generate

    def counting(self, requests):
        calls.append(len(requests))
        return original(self, requests)

    monkeypatch.setattr(PlainEngine, "generate", counting)
    again = generate_samples(loaded, prompts, path, max_new_tokens=6, batch=2, progress=False)
    assert calls == [1]  # only the prompt not answered before is generated
    assert [s.id for s in again] == [p.id for p in prompts]
    assert [s.response_ids for s in again[:2]] == [s.response_ids for s in first]
    assert len(load_samples(path)) == 3
    alone = original(PlainEngine(loaded), [_request(prompts[2], 6)])[0]
    assert again[2].response_ids == alone.token_ids


def test_features_match_the_sequence_and_give_the_targets_choices(loaded, tmp_path):
    samples = generate_samples(loaded, training_prompts()[:2], tmp_path / "s.jsonl", 5, 2, progress=False)
    layers = [4, loaded.model.config.num_hidden_layers]
    features, choices = extract_features(loaded, samples, layers, progress=False)
    hidden = loaded.model.config.hidden_size
    for sample, f, c in zip(samples, features, choices, strict=True):
        assert f.shape == (len(sample.ids), 2 * hidden) and f.dtype == torch.bfloat16
        # the target's choice after each prompt/answer token is the next answer token (greedy)
        p = len(sample.prompt_ids)
        assert c[p - 1 : -1].tolist() == sample.response_ids
        with torch.inference_mode():
            logits = loaded.model.lm_head(f[:, hidden:].float())
        assert (logits.argmax(-1) == c).float().mean() > 0.9  # bfloat16 rounding may flip near-ties


def test_the_cache_is_keyed_by_the_targets_fingerprint(loaded, tmp_path):
    other = as_loaded(tiny_model(loaded.model.config.vocab_size, seed=3), loaded.tokenizer)
    assert data_dir(loaded, tmp_path) != data_dir(other, tmp_path)
    assert data_dir(loaded, tmp_path) == data_dir(loaded, tmp_path)


def test_shallow_features_run_only_the_layers_they_need_and_match_the_full_pass(loaded, tmp_path):
    samples = generate_samples(loaded, training_prompts()[:2], tmp_path / "s.jsonl", 5, 2, progress=False)
    full, _ = extract_features(loaded, samples, [4], progress=False)
    ran = []
    hook = loaded.model.model.layers[10].register_forward_hook(lambda *a: ran.append(1))
    try:
        shallow, choices = extract_features(loaded, samples, [4], progress=False, choices=False)
    finally:
        hook.remove()
    assert not ran and choices == []
    for a, b in zip(full, shallow, strict=True):
        torch.testing.assert_close(a, b)
