"""Choosing an engine: the torch engine everywhere, the llama.cpp engine where it is installed and
the target came from a GGUF file, and a clear error saying why where not."""

import sys
from dataclasses import replace

import pytest
from pydantic import ValidationError

from backends.engines import build_engine, gguf_file
from backends.engines import llamacpp as llamacpp_module
from backends.engines.torch_paged import TorchPagedEngine
from backends.errors import ModelLoadError
from backends.models import LoadedModel
from backends.scheduler import LoopSettings


def test_the_torch_engine_is_the_default(tiny_target: LoadedModel) -> None:
    engine = build_engine(tiny_target, LoopSettings(max_batch=2, kv_cache_tokens=256))
    assert isinstance(engine, TorchPagedEngine) and engine.name == "torch"
    assert engine.sequence_tokens == 256
    assert engine.vocab_size == tiny_target.model.config.vocab_size


def test_the_llama_cpp_engine_serves_gguf_files_only(tiny_target: LoadedModel) -> None:
    with pytest.raises(ModelLoadError, match="serves GGUF files"):
        gguf_file(replace(tiny_target, gguf=None))


def test_without_llama_cpp_the_error_says_how_to_install_it(monkeypatch, tiny_target, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails, as where it never built
    llamacpp_module.llama_unavailable.cache_clear()
    try:
        reason = llamacpp_module.llama_unavailable()
        assert reason is not None and "pip install llama-cpp-python" in reason
        target = replace(tiny_target, gguf=tmp_path / "model.gguf")
        with pytest.raises(ModelLoadError, match="llama.cpp is unavailable"):
            build_engine(target, LoopSettings(engine="llamacpp", max_batch=2, kv_cache_tokens=256))
    finally:
        llamacpp_module.llama_unavailable.cache_clear()


def test_requantized_weights_are_the_llama_cpp_engines_only() -> None:
    assert LoopSettings(engine="llamacpp", gguf_weights="Q8_0").gguf_weights == "Q8_0"
    with pytest.raises(ValidationError, match="gguf_weights Q4_0 requantizes the .gguf file .* set engine llamacpp"):
        LoopSettings(gguf_weights="Q4_0")
    with pytest.raises(ValidationError, match="gguf_weights"):
        LoopSettings(engine="llamacpp", gguf_weights="Q3_K")
