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
# The groups that take longest (minutes each, measured with `make test`'s --durations), started first.
LONGEST_GROUPS = ("ray", "profiling", "training")

# `make test` runs the suite on pytest-xdist workers, one per core: each worker computes with its
# share of the cores, so two workers on two cores do not slow each other down many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def _group(item: pytest.Item) -> str:
    """An item's pytest-xdist group: its own mark's, else its module's, so that a module's fixtures
    (a profile, trained drafters, step costs, a report) are built on one worker, not on each."""
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark and mark.args else item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test runs in a group (see `_group`); the Ray tests are one group. The longest groups go
    first (the Ray group with the cluster's tests first), then those that load the embedded model,
    then the rest: the long units of work start at once and the short ones fill in at the end
    (`make test` keeps this order with --no-loadscope-reorder)."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        name = "ray" if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) else _group(item)
        item.add_marker(pytest.mark.xdist_group(name))  # the closest mark: the one xdist reads
        groups.setdefault(name, []).append(item)

    def weight(name: str) -> int:
        if name in LONGEST_GROUPS:
            return LONGEST_GROUPS.index(name)
        slow = any(item.get_closest_marker("slow") for item in groups[name])
        return len(LONGEST_GROUPS) + (0 if slow else 1)

    # The two-node cluster's tests first: the session's Serve application (started by the next Ray
    # tests, kept until the last) would otherwise idle beside the cluster on a share of a core.
    if "ray" in groups:
        groups["ray"].sort(key=lambda item: "cluster" not in getattr(item, "fixturenames", ()))
    items[:] = [item for name in sorted(groups, key=weight) for item in groups[name]]


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
