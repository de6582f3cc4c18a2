"""`specroute serve`'s first start: the profile it measures when none exists."""

from __future__ import annotations

from pathlib import Path

from backends.deployments import BackendSettings
from policies.profile import Profile
from profiler import profiling
from profiler.profiling import batches_up_to
from router import serve_cmd
from router.serve_cmd import ensure_profile, ensure_profiles
from router.service import ServiceSettings
from tests.policies.profiles import in_dtype, synthetic_profile


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


def test_auto_profiles_float32_then_bfloat16_on_a_cpu_that_runs_it_natively(tmp_path, monkeypatch):
    """bfloat16 reuses float32's quantized measurements: the quantized backend runs float32 kernels."""
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    monkeypatch.setattr(serve_cmd, "fast_reduced_precision", lambda device: True)
    fp32 = synthetic_profile(quantized_agreement=0.97)
    seen = []

    def fake_run_profile(config, progress, log):
        seen.append((config.dtype, config.quantization))
        measured = fp32 if config.dtype == "float32" else in_dtype(fp32, config.dtype, 0.5)
        return measured.model_copy(update={"quantized": None}) if not config.quantization else measured

    monkeypatch.setattr(profiling, "run_profile", fake_run_profile)
    paths = ensure_profiles(ServiceSettings(), log=lambda _: None)
    assert [p.name for p in paths] == ["embedded-float32-cpu.json", "embedded-bfloat16-cpu.json"]
    assert seen == [("float32", ["auto"]), ("bfloat16", [])]
    bf16 = Profile.load(paths[1])
    assert bf16.model.dtype == "bfloat16" and bf16.quantized == fp32.quantized
    assert ensure_profiles(ServiceSettings(), log=lambda _: None) == paths  # measured once
    assert len(seen) == 2


def test_auto_profiles_only_float32_where_bfloat16_would_be_emulated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    monkeypatch.setattr(serve_cmd, "fast_reduced_precision", lambda device: False)
    monkeypatch.setattr(profiling, "run_profile", lambda config, progress, log: synthetic_profile())
    lines: list[str] = []
    paths = ensure_profiles(ServiceSettings(), lines.append)
    assert [p.name for p in paths] == ["embedded-float32-cpu.json"]
    assert "bfloat16 not profiled: this CPU has no bfloat16 arithmetic" in lines[-1]


def test_a_named_dtype_profiles_that_dtype_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    monkeypatch.setattr(serve_cmd, "fast_reduced_precision", lambda device: True)
    seen = []
    monkeypatch.setattr(
        profiling, "run_profile", lambda config, progress, log: seen.append(config.dtype) or synthetic_profile()
    )
    ensure_profiles(ServiceSettings(backend=BackendSettings(dtype="float32")), log=lambda _: None)
    assert seen == ["float32"]
