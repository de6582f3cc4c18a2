"""`specroute serve`'s first start: the profile it measures when none exists."""

from __future__ import annotations

from pathlib import Path

from backends.deployments import BackendSettings
from profiler import profiling
from profiler.profiling import batches_up_to
from router.serve_cmd import ensure_profile
from router.service import ServiceSettings


class _Measured:
    def __init__(self) -> None:
        self.saved: list[Path] = []

    def save(self, path: Path) -> None:
        self.saved.append(path)


def test_a_first_start_profiles_what_the_backends_will_run(tmp_path, monkeypatch):
    """Batches up to the replicas' largest, the drafters and options the speculative backend loads;
    acceptance left to `auto`, so the shipped one stands in where it fits."""
    seen, measured = [], _Measured()

    def fake_run_profile(config, progress, log):
        seen.append(config)
        return measured

    monkeypatch.setattr(profiling, "run_profile", fake_run_profile)
    backend = BackendSettings(max_batch=24, drafters=["ngram", "eagle"], drafter={"ngram_max": 5})
    settings = ServiceSettings(backend=backend, profile=str(tmp_path / "p.json"))
    lines: list[str] = []
    assert ensure_profile(settings, lines.append) == tmp_path / "p.json"
    (config,) = seen
    assert config.batches == [1, 2, 4, 8, 16, 32] and config.drafters == ["ngram", "eagle"]
    assert config.drafter.ngram_max == 5 and config.threads == 1 and config.acceptance == "auto"
    assert measured.saved == [tmp_path / "p.json"]
    assert lines[0] == f"no profile at {tmp_path / 'p.json'}: measuring this machine first (once)"


def test_an_existing_profile_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "run_profile", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    (tmp_path / "p.json").write_text("{}")
    assert ensure_profile(ServiceSettings(profile=str(tmp_path / "p.json"))) == tmp_path / "p.json"


def test_batches_reach_the_largest_batch_in_powers_of_two():
    assert batches_up_to(32) == [1, 2, 4, 8, 16, 32]
    assert batches_up_to(33) == [1, 2, 4, 8, 16, 32, 64]
    assert batches_up_to(1) == [1, 2]  # a cost curve needs two batches
