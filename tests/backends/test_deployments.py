"""The backends' deployment classes, built without Ray Serve: the quantized backend stacked with
speculation — its rows speculate exactly to the quantized model, a row sent without a drafter
decodes plain, and what cannot speculate exactly is refused at start-up with the reason."""

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from backends.deployments import BackendSettings, QuantizedBackend
from backends.engines.llamacpp import llama_unavailable
from backends.errors import ModelLoadError
from backends.models import LoadedModel
from backends.streaming import StreamEvent
from tests.backends.conftest import PROMPTS

# One row's passes (max_batch 1) and k ≤ 4: the start-up cost probe times only what the tests use.
SMALL = {"dtype": "float32", "max_batch": 1, "k_max": 4, "kv_cache_tokens": 1024}


def _answer(backend: Any, drafter: str | None, request: int) -> StreamEvent:
    async def run() -> StreamEvent:
        events = [e async for e in backend.generate(PROMPTS[request].model_dump(mode="json"), drafter)]
        return events[-1]

    return asyncio.run(run())


def _speculates_exactly(backend: Any) -> None:
    """Plain and speculative rows of the backend give the same tokens. Its measured passes make auto k
    verify little at batch 1 here; priced flat, every proposal is verified: tokens must not depend
    on what the planner chose."""
    backend.costs.ensure(1)  # probed on first use where no profile measured its passes
    table = backend.costs.target_s
    for batch, width in list(table):
        table[batch, width] = table[batch, 1]
    judged = 0
    for request in (0, 7):  # prompts that repeat their own text: prompt lookup has something to propose
        plain, stacked = _answer(backend, None, request), _answer(backend, "ngram", request)
        assert plain.result is not None and stacked.result is not None, (plain.error, stacked.error)
        assert plain.result.speculation is None  # sent without a drafter: plain rows
        stats = stacked.result.speculation
        assert stats is not None and stats.drafter == "ngram"
        assert stacked.result.token_ids == plain.result.token_ids
        judged += stats.judged_tokens
    assert judged > 0  # drafts were verified: the equality above tested something


@pytest.mark.skipif(llama_unavailable() is not None, reason="llama-cpp-python is not installed here")
def test_the_llamacpp_quantized_backend_speculates_exactly_to_its_weights(loaded: LoadedModel) -> None:
    backend = QuantizedBackend.func_or_class({**SMALL, "engine": "llamacpp", "gguf_weights": "Q8_0"})
    try:
        assert backend.names == {"ngram": "ngram"}  # the engine's default: prompt lookup
        _speculates_exactly(backend)
    finally:
        backend.loop.close()  # its thread first: the engine is freed under no step


def test_the_torch_quantized_backend_speculates_exactly_on_width_invariant_passes(loaded: LoadedModel) -> None:
    settings = {**SMALL, "quantization": "int4-weight-only", "quantized_drafters": ["ngram"]}
    backend = QuantizedBackend.func_or_class(settings)
    try:
        # torch's int kernels vary with a pass's width: speculating, its passes run tiled
        assert backend.loop.scheduler.tile == backend.settings.tile_width
        _speculates_exactly(backend)
    finally:
        backend.loop.close()  # its thread first: the engine is freed under no step


def test_the_torch_quantized_backend_decodes_plain_by_default(loaded: LoadedModel) -> None:
    assert BackendSettings().quantized_drafters is None
    backend = QuantizedBackend.func_or_class({**SMALL, "quantization": "int8-weight-only"})
    try:
        assert backend.drafters == [] and backend.loop.scheduler.tile is None
        assert backend.drafter_name("ngram") is None
    finally:
        backend.loop.close()  # its thread first: the engine is freed under no step


def test_activation_quantization_cannot_speculate_exactly(loaded: LoadedModel) -> None:
    with pytest.raises(ModelLoadError, match="one scale per pass.*quantized_drafters: \\[\\]"):
        QuantizedBackend.func_or_class({**SMALL, "quantization": "dynamic", "quantized_drafters": ["ngram"]})


@pytest.mark.parametrize("kinds", [["eagle"], ["model"]])
def test_quantized_drafters_read_only_tokens_and_are_loaded(kinds: list[str]) -> None:
    with pytest.raises(ValidationError, match="cannot draft for the quantized backend"):
        BackendSettings(drafters=["ngram", "eagle"], quantized_drafters=kinds)
