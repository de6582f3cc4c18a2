"""The linear kernels a CPU model runs are measured once per machine, model, dtype and thread
count, kept, and overridable; packing must win by MIN_GAIN; an exact engine stays exact on either."""

import json

import pytest
import torch

from backends import kernels
from backends.errors import ModelLoadError
from backends.generation import GenerationRequest
from backends.kernels import (
    KERNELS_ENV,
    MIN_GAIN,
    KernelChoice,
    apply_linear_kernels,
    choice_path,
    choose_linear_kernels,
)
from backends.packing import is_packed, packing_available
from backends.scheduler import Scheduler
from backends.speculative.engine import SpeculativeEngine
from backends.speculative.factory import build_drafter
from policies.drafters import DrafterConfig
from profiler.workloads import load_prompt_set

from ..conftest import NATIVE_BF16_ONLY
from .conftest import tiny_model

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    return tmp_path


def timings(packed_ms: float, torch_ms: float):
    """A stand-in for `time_both` that reports fixed times and counts its calls."""
    calls = []

    def time_both(model):
        calls.append(model)
        return {"packed": {1: packed_ms, 9: packed_ms}, "torch": {1: torch_ms, 9: torch_ms}}

    return time_both, calls


@pytest.mark.parametrize(
    ("packed_ms", "torch_ms", "want"),
    [(10.0, 10.0 * MIN_GAIN * 1.01, "packed"), (10.0, 10.0 * MIN_GAIN * 0.99, "torch"), (12.0, 10.0, "torch")],
)
def test_auto_packs_only_where_packing_wins_by_the_margin(home, monkeypatch, packed_ms, torch_ms, want):
    monkeypatch.setattr(kernels, "time_both", timings(packed_ms, torch_ms)[0])
    model = tiny_model(vocab_size=128, seed=0)
    choice = choose_linear_kernels(model, "float32")
    assert choice.kernel == want and choice.source == "measured"
    assert is_packed(model) == (want == "packed")
    assert choice.gain() == pytest.approx(torch_ms / packed_ms, rel=1e-3)  # kept to 0.01 ms
    assert f"{packed_ms:.1f} / {packed_ms:.1f} ms packed" in choice.reason()


def test_a_machine_measures_once_and_keys_the_choice_by_dtype_and_threads(home, monkeypatch):
    time_both, calls = timings(5.0, 10.0)
    monkeypatch.setattr(kernels, "time_both", time_both)
    model = tiny_model(vocab_size=128, seed=0)
    first = choose_linear_kernels(model, "float32")
    again = choose_linear_kernels(tiny_model(vocab_size=128, seed=1), "float32")
    assert len(calls) == 1 and again.source == "cached" and again.kernel == first.kernel == "packed"
    assert again.packed_ms == first.packed_ms and "on this machine" in again.reason()
    kept = json.loads(choice_path(model, "float32").read_text())
    assert kept["kernel"] == "packed" and kept["cpu"] == kernels.cpu_identity()
    assert choice_path(model, "bfloat16") != choice_path(model, "float32")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        other = choice_path(model, "float32")
    finally:
        torch.set_num_threads(threads)
    assert other != choice_path(model, "float32")


def test_an_unreadable_kept_choice_is_measured_again(home, monkeypatch):
    time_both, calls = timings(10.0, 5.0)
    monkeypatch.setattr(kernels, "time_both", time_both)
    model = tiny_model(vocab_size=128, seed=0)
    path = choice_path(model, "float32")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert choose_linear_kernels(model, "float32").source == "measured" and len(calls) == 1
    assert KernelChoice.model_validate_json(path.read_text()).kernel == "torch"


def test_a_setting_overrides_the_measurement(home, monkeypatch):
    time_both, calls = timings(5.0, 10.0)
    monkeypatch.setattr(kernels, "time_both", time_both)
    model = tiny_model(vocab_size=128, seed=0)
    assert choose_linear_kernels(model, "float32", "torch").source == "setting" and not is_packed(model)
    monkeypatch.setenv(KERNELS_ENV, "packed")
    choice = choose_linear_kernels(model, "float32")
    assert (choice.kernel, choice.source) == ("packed", "setting") and is_packed(model)
    assert calls == []
    with pytest.raises(ModelLoadError, match="unknown linear kernels 'fast': use one of auto, packed, torch"):
        choose_linear_kernels(model, "float32", "fast")


def test_the_real_measurement_times_both_kernels_at_every_width(home):
    model = tiny_model(vocab_size=128, seed=0)
    best = kernels.time_both(model, widths=(1, 3), rounds=2)
    assert set(best) == {"packed", "torch"}
    assert all(set(times) == {1, 3} and min(times.values()) > 0 for times in best.values())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=NATIVE_BF16_ONLY)])
def test_speculation_stays_token_identical_to_plain_on_either_kernel(dtype, request):
    """Whichever kernels a machine chooses, spec and plain decoding run the same ones, so the
    exactness the engine tests check on the chosen kernels holds on the other too."""
    loaded = request.getfixturevalue("loaded" if dtype == "float32" else "loaded_bf16")
    prompts = load_prompt_set("project").categories
    requests = [
        GenerationRequest(messages=prompts[c].prompts[0].messages, max_tokens=24) for c in ("summarization", "code")
    ]
    chosen = loaded.info.linear_kernels
    costs = request.getfixturevalue("costs") if dtype == "float32" else None  # the session's table, where one is
    try:
        for kernel in ("packed", "torch"):
            apply_linear_kernels(loaded.model, kernel)
            plain = [Scheduler(loaded).generate([r])[0].token_ids for r in requests]
            engine = SpeculativeEngine(loaded, build_drafter(DrafterConfig(kind="ngram"), loaded), k=8, costs=costs)
            assert [engine.generate([r])[0].token_ids for r in requests] == plain, kernel
            assert engine.totals.accepted_tokens > 0
    finally:
        apply_linear_kernels(loaded.model, chosen)
