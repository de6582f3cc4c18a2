"""The llama.cpp engine under the step loop, on the embedded model's own GGUF file: it computes
what llama.cpp's own generation computes, speculation on it returns its plain tokens, a row's
tokens do not depend on its batch-mates, and what it cannot serve is refused with the reason."""

from pathlib import Path

import numpy as np
import pytest

from backends.embedded import specroute_home
from backends.engines import build_engine, gguf_file
from backends.engines.llamacpp import (
    KV_TYPE_Q8_0,
    LlamaCppEngine,
    gguf_weight_types,
    llama_unavailable,
    pass_variance,
    requantized,
)
from backends.errors import ModelLoadError, RequestError
from backends.generation import GenerationRequest
from backends.models import LoadedModel
from backends.plain import prompt_ids
from backends.scheduler import LoopSettings, Scheduler
from backends.speculative.engine import SpeculativeEngine
from tests.backends.conftest import PROMPTS, lookup

pytestmark = pytest.mark.skipif(
    llama_unavailable() is not None, reason="llama-cpp-python is not installed here (`make install` builds it)"
)
SETTINGS = LoopSettings(engine="llamacpp", max_batch=8, kv_cache_tokens=8 * 512)


@pytest.fixture(scope="module")
def plain(loaded: LoadedModel) -> Scheduler:
    return Scheduler(loaded, SETTINGS)


@pytest.fixture(scope="module")
def alone(plain: Scheduler) -> list[list[int]]:
    """The llama.cpp engine's plain greedy tokens for each prompt decoded alone."""
    return [plain.generate([r])[0].token_ids for r in PROMPTS]


def test_plain_decoding_is_llama_cpps_own_generation(loaded: LoadedModel, alone: list[list[int]]) -> None:
    """The same tokens as llama.cpp's own greedy generation of the file (`Llama.generate`) with the
    engine's attention settings: flash attention over a Q8_0 cache."""
    import llama_cpp

    peer = llama_cpp.Llama(
        str(loaded.gguf),
        n_ctx=512,
        n_threads=1,
        flash_attn=True,
        type_k=KV_TYPE_Q8_0,
        type_v=KV_TYPE_Q8_0,
        verbose=False,
    )
    eos = Scheduler(loaded, SETTINGS).plain.eos_ids
    for request, ours in zip(PROMPTS, alone, strict=True):
        theirs = []
        for token in peer.generate(prompt_ids(loaded.tokenizer, request), temp=0.0, top_k=1, reset=True):
            theirs.append(token)
            if token in eos or len(theirs) == request.max_tokens:
                break
        assert theirs == ours


def test_speculation_returns_the_engines_plain_tokens(loaded: LoadedModel, alone: list[list[int]]) -> None:
    """A fixed k verifies every proposal (the copying prompts accept some); auto k verifies what
    this machine's measured pass costs say pays. Either way: the plain tokens."""
    fixed = SpeculativeEngine(loaded, lookup(), k=4, settings=SETTINGS)
    assert [fixed.generate([r])[0].token_ids for r in PROMPTS] == alone
    assert fixed.totals.accepted_tokens > 0
    auto = SpeculativeEngine(loaded, lookup(), k="auto", settings=SETTINGS)
    assert [auto.generate([r])[0].token_ids for r in PROMPTS] == alone


def test_a_rows_tokens_do_not_depend_on_its_batch(loaded: LoadedModel, alone: list[list[int]]) -> None:
    """Every prompt in one batch (rows of different lengths leave at different steps) and, with
    drafts, in another: each row's tokens are those it decodes alone."""
    assert [r.token_ids for r in Scheduler(loaded, SETTINGS).generate(PROMPTS)] == alone
    engine = SpeculativeEngine(loaded, lookup(), k=3, settings=SETTINGS)
    assert [r.token_ids for r in engine.generate(PROMPTS)] == alone


def test_a_cut_back_row_computes_again_what_it_computed(loaded: LoadedModel) -> None:
    engine = build_engine(loaded, SETTINGS)
    seq = engine.add(reserve=64)
    tokens = np.random.default_rng(0).integers(0, engine.vocab_size, 12).tolist()
    first = engine.logits([seq], [tokens])
    engine.truncate(seq, 4)
    assert engine.length(seq) == 4
    again = engine.logits([seq], [tokens[4:]])
    assert first.shape == (1, 12, engine.vocab_size)
    assert bool((again[0] == first[0, 4:]).all())
    last = engine.last_logits([seq], [[tokens[0]]])
    assert last.shape == (1, engine.vocab_size) and engine.length(seq) == 13
    engine.remove(seq)
    assert engine.usage == 0.0


def test_rows_have_their_share_of_the_cache(loaded: LoadedModel, plain: Scheduler) -> None:
    engine = build_engine(loaded, SETTINGS)
    assert engine.sequence_tokens == 512
    assert engine.can_reserve(512) and not engine.can_reserve(513)
    too_long = GenerationRequest(prompt="Hello", max_tokens=600)
    with pytest.raises(RequestError, match="this backend holds 512"):
        plain.check(too_long)


@pytest.mark.parametrize(
    ("attribute", "value", "reason"),
    [
        ("feature_layers", (3,), "hidden states"),
        ("widest_block", 6, "tree-shaped blocks"),
        ("reads_target_layers", True, "own layers"),
    ],
)
def test_drafters_needing_more_than_tokens_are_refused(loaded: LoadedModel, attribute, value, reason) -> None:
    drafter = lookup()
    setattr(drafter, attribute, value)
    with pytest.raises(RequestError, match=f"llamacpp engine cannot serve drafter ngram: .*{reason}"):
        Scheduler(loaded, SETTINGS, [drafter])


def test_a_target_without_a_gguf_file_is_refused(loaded: LoadedModel) -> None:
    from dataclasses import replace

    with pytest.raises(ModelLoadError, match="serves GGUF files"):
        gguf_file(replace(loaded, gguf=None))


def test_requantized_weights_are_made_once(loaded: LoadedModel, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))  # made here, whatever another home holds
    path = requantized(loaded.gguf, "Q8_0")
    made = path.stat().st_mtime_ns
    assert requantized(loaded.gguf, "Q8_0") == path and path.stat().st_mtime_ns == made
    assert path.parent == specroute_home() / "cache" / "gguf" and "Q8_0" in gguf_weight_types(path)
    assert gguf_file(loaded, "Q8_0") == path and gguf_file(loaded) == loaded.gguf
    assert requantized(loaded.gguf, "file") == loaded.gguf


@pytest.mark.parametrize("weights", ["Q8_0", "F16"])
def test_speculation_on_requantized_weights_is_exact_to_them_or_refused(loaded: LoadedModel, weights) -> None:
    """Whether llama.cpp's kernels for a weight type are width- and batch-invariant depends on the
    type and the CPU (on an AVX2 EPYC: Q8_0 is, F16 is not), so the engine probes it at start-up:
    speculation where invariant returns the weights' own plain tokens, alone and batched;
    elsewhere it is refused with what the probe found."""
    settings = SETTINGS.model_copy(update={"gguf_weights": weights})
    plain = Scheduler(loaded, settings)
    variance = pass_variance(str(gguf_file(loaded, weights)), plain.cache.threads)
    if variance is not None:
        with pytest.raises(
            RequestError, match=f"speculation would not return these weights' plain tokens: .*{weights}"
        ):
            SpeculativeEngine(loaded, lookup(), k=4, settings=settings)
        return
    requests = PROMPTS[:4]
    alone = [plain.generate([r])[0].token_ids for r in requests]
    engine = SpeculativeEngine(loaded, lookup(), k=4, settings=settings)
    assert [engine.generate([r])[0].token_ids for r in requests] == alone
    assert [r.token_ids for r in engine.generate(requests)] == alone


def test_the_probe_finds_a_pass_that_changes_a_logit(loaded: LoadedModel, monkeypatch) -> None:
    """A block whose logits differ from one-at-a-time decoding by any amount is reported, with where."""
    path = str(loaded.gguf)
    honest = pass_variance(path, 1)
    original = LlamaCppEngine.logits

    def skewed(self, seqs, blocks, width=None, structures=None):
        out = original(self, seqs, blocks, width, structures)
        if len(blocks[0]) > 1:  # every multi-token block; the one-at-a-time reference is untouched
            out[0, 0, 0] += 0.5
        return out

    monkeypatch.setattr(LlamaCppEngine, "logits", skewed)
    pass_variance.cache_clear()
    try:
        found = pass_variance(path, 1)
    finally:
        pass_variance.cache_clear()
    assert found is not None and "changed a logit" in found and Path(path).name in found
    if honest is None:  # the first case that differs is then the skewed one
        assert found.startswith("a block of 2 token(s) in a batch of 1 changed a logit by 0.5")
