"""Shared fixtures: the embedded model is loaded once per session, strictly offline."""

import os

# Tests never reach a model hub: set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from backends.embedded import prepare_embedded_model  # noqa: E402
from backends.models import LoadedModel, load_model, load_tokenizer  # noqa: E402
from backends.plain import PlainEngine  # noqa: E402
from profiler.hardware import NO_FAST_BF16, fast_reduced_precision  # noqa: E402

# Where the CPU has no bfloat16 arithmetic, bfloat16 is never served (dtype auto serves float32) and
# every bfloat16 pass of the embedded model is emulated: a test of it takes minutes. Such tests are
# skipped there; the properties of the engine they check also run on the tiny bfloat16 model, on
# every machine (the benches in bfloat16 run where bfloat16 does).
NATIVE_BF16_ONLY = pytest.mark.skipif(
    not fast_reduced_precision(),
    reason=f"{NO_FAST_BF16}: bfloat16 is never served here, and every bfloat16 pass of the embedded model is emulated",
)

# The tests that start Ray (the session's Serve application, the two-node cluster) run on one
# pytest-xdist worker, one after another: one Ray instance at a time on the service's port.
RAY_FIXTURES = {"service", "cluster"}

# `make test` runs the suite on pytest-xdist workers, one per core: each worker computes with its
# share of the cores, so two workers on two cores do not slow each other down many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The Ray tests are one group, put first (in their own order): the longest unit of work starts
    at once on one worker while the other works through the rest, instead of running alone at the end."""
    ray = [item for item in items if RAY_FIXTURES & set(getattr(item, "fixturenames", ()))]
    for item in ray:
        item.add_marker(pytest.mark.xdist_group("ray"))
    grouped = set(map(id, ray))
    items[:] = ray + [item for item in items if id(item) not in grouped]


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
