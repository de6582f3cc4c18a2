"""Which profiles `dtype: auto` reads, and what it says when one is missing."""

from __future__ import annotations

from policies.config import default_policy
from profiler.profiling import default_profile_path
from router import dtype_choice
from router.dtype_choice import decide_dtype
from router.service import ServiceSettings, resolve_dtype
from tests.policies.profiles import in_dtype, synthetic_profile


def _save(tmp_path, monkeypatch, *dtypes_speeds):
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    fp32 = synthetic_profile(quantized_agreement=0.97)
    for dtype, speed in dtypes_speeds:
        profile = fp32 if dtype == "float32" else in_dtype(fp32, dtype, speed)
        profile.save(default_profile_path("embedded", dtype, "cpu"))


def test_auto_serves_the_faster_exact_dtype_profiled_here(tmp_path, monkeypatch):
    _save(tmp_path, monkeypatch, ("float32", 1.0), ("bfloat16", 0.5))
    settings = resolve_dtype(ServiceSettings())
    assert settings.backend.dtype == "bfloat16"
    assert settings.profile_path().name == "embedded-bfloat16-cpu.json"
    assert settings.dtype_choice.source == "measured" and settings.dtype_choice.reason.startswith("bfloat16: ")
    assert resolve_dtype(settings) is settings  # decided once, before the app is built


def test_auto_says_why_bfloat16_is_missing(tmp_path, monkeypatch):
    _save(tmp_path, monkeypatch, ("float32", 1.0))
    monkeypatch.setattr(dtype_choice, "fast_reduced_precision", lambda device: False)
    choice = decide_dtype("embedded", "auto", "cpu", None, default_policy())
    assert choice.dtype == "float32" and "bfloat16 not profiled: this CPU has no bfloat16 arithmetic" in choice.reason
    monkeypatch.setattr(dtype_choice, "fast_reduced_precision", lambda device: True)
    choice = decide_dtype("embedded", "auto", "cpu", None, default_policy())
    assert "`specroute profile --dtype bfloat16` adds it" in choice.reason


def test_a_named_dtype_or_an_explicit_profile_decides_without_comparing(tmp_path, monkeypatch):
    _save(tmp_path, monkeypatch, ("float32", 1.0), ("bfloat16", 0.5))
    named = decide_dtype("embedded", "float32", "cpu", None, default_policy())
    assert (named.dtype, named.source) == ("float32", "configured") and len(named.outlooks) == 2
    path = default_profile_path("embedded", "bfloat16", "cpu")
    given = decide_dtype("embedded", "auto", "cpu", str(path), default_policy())
    assert given.dtype == "bfloat16" and str(path) in given.reason
