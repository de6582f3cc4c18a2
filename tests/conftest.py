"""Shared fixtures: the embedded model is loaded once per session, strictly offline."""

import os

# Tests never reach a model hub: set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from backends.embedded import prepare_embedded_model  # noqa: E402
from backends.models import LoadedModel, load_model, load_tokenizer  # noqa: E402
from backends.plain import PlainEngine  # noqa: E402


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    prepare_embedded_model(log=lambda _: None)  # a no-op once `specroute setup` has run
    return load_model("embedded", dtype="float32")


@pytest.fixture(scope="session")
def loaded_bf16() -> LoadedModel:
    """The embedded model in bfloat16, where only width-invariant passes keep speculation exact."""
    prepare_embedded_model(log=lambda _: None)
    return load_model("embedded", dtype="bfloat16")


@pytest.fixture(scope="session")
def engine(loaded: LoadedModel) -> PlainEngine:
    return PlainEngine(loaded)


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer alone: tests of tiny random models need no real weights."""
    prepare_embedded_model(log=lambda _: None)
    return load_tokenizer("embedded")
