"""`specroute serve`'s first start: the quick probe it measures when no profile exists, and the full
profile it then measures in the background, paused while requests are in flight."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from backends.deployments import BackendSettings
from policies.profile import Profile
from profiler import profiling
from profiler.profiling import batches_up_to
from router import serve_cmd
from router.serve_cmd import (
    BackgroundProfile,
    ProfileJob,
    completion_jobs,
    ensure_profile,
    ensure_profiles,
    profile_config,
    serve_config,
)
from router.service import ServiceSettings
from tests.policies.profiles import in_dtype, synthetic_profile


class _Measured:
    def __init__(self) -> None:
        self.saved: list[Path] = []

    def save(self, path: Path) -> None:
        self.saved.append(path)


def test_a_first_start_probes_what_the_backends_will_run(tmp_path, monkeypatch):
    """A quick probe of the drafters and options the speculative backend loads; acceptance left to
    `auto` with the full run's settings, so the shipped one stands in where it fits."""
    seen, measured = [], _Measured()

    def fake_run_profile(config, progress, log):
        seen.append(config)
        return measured

    monkeypatch.setattr(profiling, "run_profile", fake_run_profile)
    backend = BackendSettings(max_batch=24, drafters=["ngram", "eagle"], drafter={"ngram_max": 5})
    settings = ServiceSettings(backend=backend, profile=str(tmp_path / "p.json"))
    lines: list[str] = []
    assert ensure_profile(settings, lines.append, probe=True) == tmp_path / "p.json"
    (config,) = seen
    # Every batch bucket the speculative backend runs (else it probes them itself at start), one sweep.
    assert config.probe and config.batches == [1, 2, 4, 8, 16, 32] and config.drafters == ["ngram", "eagle"]
    assert config.context_budget_s == 0 and config.curve_sweeps == 1 and config.repeats == profiling.PROBE_REPEATS
    assert config.quantization == []  # left to the full profile
    assert config.drafter.ngram_max == 5 and config.threads == 1 and config.acceptance == "auto"
    full = profile_config(settings.with_dtype("float32"))
    assert not full.probe and full.quantization == ["auto"] and full.context_budget_s > 0
    probe, reference = config.model_dump(), full.model_dump()
    assert all(probe[name] == reference[name] for name in profiling.SEED_SETTINGS)  # the seed fits both alike
    assert measured.saved == [tmp_path / "p.json"]
    assert lines[0].startswith(f"no profile at {tmp_path / 'p.json'}: a quick probe of this machine first")


def test_without_probe_the_first_start_measures_in_full(tmp_path, monkeypatch):
    """What `specroute report --measure` and the fault bench ask for: a full profile, as before."""
    seen: list = []
    monkeypatch.setattr(profiling, "run_profile", lambda config, progress, log: seen.append(config) or _Measured())
    lines: list[str] = []
    ensure_profile(ServiceSettings(profile=str(tmp_path / "p.json")), lines.append)
    assert not seen[0].probe and seen[0].batches == [1, 2, 4, 8, 16, 32] and seen[0].context_budget_s > 0
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


def provisional(profile: Profile) -> Profile:
    return profile.model_copy(update={"provisional": True})


def test_the_provisional_profiles_are_completed_float32_first(tmp_path, monkeypatch):
    """bfloat16's full run takes float32's quantized measurements, as its probe did; a full
    profile is left as it is."""
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    fp32, bf16 = tmp_path / "fp32.json", tmp_path / "bf16.json"
    provisional(synthetic_profile()).save(fp32)
    provisional(in_dtype(synthetic_profile(), "bfloat16", 0.5)).save(bf16)
    jobs = completion_jobs(ServiceSettings(), [fp32, bf16])
    assert [(j.path, j.config.dtype, j.quantized_from) for j in jobs] == [
        (fp32, "float32", None),
        (bf16, "bfloat16", fp32),
    ]
    assert [j.config.quantization for j in jobs] == [["auto"], []]
    assert not any(j.config.probe for j in jobs) and jobs[0].config.batches == [1, 2, 4, 8, 16, 32]
    synthetic_profile().save(fp32)
    assert [j.path for j in completion_jobs(ServiceSettings(), [fp32, bf16])] == [bf16]


def test_with_engine_auto_each_engines_full_profile_keeps_its_own_drafters(tmp_path):
    """Jobs come from the settings as asked for (serve_forever builds them before deciding the
    engine): the llama.cpp profile measures prompt lookup only, torch's every served kind."""
    from policies.drafters import SERVED_KINDS
    from tests.policies.profiles import on_llamacpp

    torch_path, llama_path = tmp_path / "torch.json", tmp_path / "llama.json"
    provisional(synthetic_profile()).save(torch_path)
    provisional(on_llamacpp(synthetic_profile(), 0.3, 0.97)).save(llama_path)
    jobs = completion_jobs(ServiceSettings.model_validate({"backend": {"engine": "auto"}}), [torch_path, llama_path])
    assert [(j.config.engine, j.config.drafters, j.quantized_from) for j in jobs] == [
        ("torch", list(SERVED_KINDS), None),
        ("llamacpp", ["ngram"], None),
    ]
    assert jobs[1].config.gguf_quantized == ["Q8_0"] and jobs[1].config.quantization == []


def test_a_finished_profile_reaches_the_router_through_its_user_config(tmp_path):
    """The app's args stay the same (no replica restarts): only the Router's user_config changes."""
    settings = ServiceSettings(profile=str(tmp_path / "p.json"))
    before = serve_config(settings)
    after = serve_config(settings, {"speculation": {"enabled": False}}, profile=tmp_path / "p.json")
    assert before["applications"][0]["args"] == after["applications"][0]["args"]
    assert "deployments" not in before["applications"][0]
    (router,) = after["applications"][0]["deployments"]
    assert router["user_config"] == {"policy": {"speculation": {"enabled": False}}, "profile": str(tmp_path / "p.json")}


class _Child:
    pid = 4242

    def is_alive(self) -> bool:
        return True


def test_the_background_profiler_pauses_while_requests_run_and_resumes_once_idle(monkeypatch):
    sent: list[int] = []
    monkeypatch.setattr(serve_cmd, "_signal", lambda process, signum: sent.append(signum))
    monkeypatch.setattr(serve_cmd, "IDLE_BEFORE_RESUME_S", 0.05)
    background = BackgroundProfile([])
    background.process = _Child()  # type: ignore[assignment]
    background.poll(busy=True)
    background.poll(busy=True)
    assert sent == [signal.SIGSTOP]  # stopped once, however long the requests run
    background.poll(busy=False)
    assert sent == [signal.SIGSTOP]  # idle, but not for long enough yet
    time.sleep(0.06)
    background.poll(busy=False)
    assert sent == [signal.SIGSTOP, signal.SIGCONT]
    assert background.paused_s.value >= 0.05  # the child's budget clock leaves the pause out


class _Ended:
    pid = 4242

    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode

    def is_alive(self) -> bool:
        return False


@pytest.mark.parametrize("exitcode,left_provisional", [(0, False), (3, True), (0, True)])
def test_only_a_finished_profile_is_reported_when_its_child_ends(tmp_path, exitcode, left_provisional):
    path = tmp_path / "p.json"
    profile = synthetic_profile()
    (provisional(profile) if left_provisional else profile).save(path)
    job = ProfileJob(profile_config(ServiceSettings().with_dtype("float32")), path)
    lines: list[str] = []
    background = BackgroundProfile([], log=lines.append)
    background.process, background.job = _Ended(exitcode), job  # type: ignore[assignment]
    finished = background.poll(busy=False)
    assert background.done and finished == (None if left_provisional else job)
    expected = "the full float32 profile failed" if left_provisional else "full float32 profile written"
    assert lines[-1].startswith(expected)


def _write_full_when_told(config_json, path, quantized_from, log_path, paused_s) -> None:
    """A child that 'measures' until a file says it may finish, then writes a full profile."""
    while not Path(path).with_suffix(".go").exists():
        time.sleep(0.02)
    synthetic_profile().save(Path(path))


def _eventually(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]


@pytest.mark.slow  # a spawned child imports the service's modules afresh (~15 s here)
def test_a_real_child_is_stopped_while_busy_and_its_profile_reported_when_written(tmp_path):
    path = tmp_path / "p.json"
    provisional(synthetic_profile()).save(path)
    job = ProfileJob(profile_config(ServiceSettings().with_dtype("float32")), path)
    lines: list[str] = []
    background = BackgroundProfile([job], log=lines.append, measure=_write_full_when_told)
    try:
        background.poll(busy=True)
        pid = background.process.pid
        assert _eventually(lambda: _state(pid) == "T")  # stopped while requests are in flight
        path.with_suffix(".go").touch()
        time.sleep(serve_cmd.IDLE_BEFORE_RESUME_S + 0.1)
        finished, deadline = None, time.monotonic() + 120
        while finished is None and time.monotonic() < deadline:
            finished = background.poll(busy=False)
            time.sleep(0.05)
        assert finished == job and background.done and not Profile.load(path).provisional
        assert lines[0].startswith("measuring the full float32 profile in the background")
    finally:
        background.stop()
