"""What a report reads: the profile, the workload, the policy and the benches' JSON — each
found, or named as missing with the command that makes it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backends.scheduler import LoopSettings
from policies.config import PolicyConfig, default_policy, load_policy
from policies.errors import UserError
from policies.profile import Profile
from policies.workload import Workload, load_workload
from profiler.bench_model_fit import ModelFitReport
from profiler.bench_spec import BenchSpecReport
from profiler.profiling import default_profile_path

from ..load_report import LoadReport
from . import data as r

DEFAULT_INPUTS = {"load": "bench-load.json", "spec": "bench-spec.json", "fit": "bench-model-fit.json"}


class ReportError(UserError):
    """An input the report cannot use, said so the user can fix it."""


class ReportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workload: str = Field(description="the workload YAML")
    out: str = Field(description="directory for report.html, report.md, report.json and the plots")
    profile: str | None = Field(None, description="default: the embedded model's under SPECROUTE_HOME")
    load_results: list[str] = Field(
        default_factory=list,
        description="`bench load --out` JSONs, e.g. a closed and an open loop (default: ./bench-load.json)",
    )
    bench_spec: str | None = Field(None, description="`bench spec --out` JSON (default: ./bench-spec.json if any)")
    model_fit: str | None = Field(None, description="`bench model-fit --out` JSON (default: ./bench-model-fit.json)")
    compare_profiles: list[str] = Field(default_factory=list, description="profiles of other machines to what-if")
    other_engine: bool = Field(
        True,
        description="with the default profile: also what-if the embedded model's profile on this machine's other "
        "engine (torch / llama.cpp) where SPECROUTE_HOME has one, so the candidates include both engines",
    )
    policy: str | None = Field(None, description="policy YAML (default: the built-in policy)")
    requests: int = Field(1200, ge=50, le=200_000, description="simulated requests per what-if run")
    max_replicas: int = Field(64, ge=1, le=4096, description="most replicas the sizing tries")
    seed: int = Field(0, ge=0)


@dataclass
class Inputs:
    """Everything the report reads, each with its InputFile line."""

    profile: Profile
    policy: PolicyConfig
    workload: Workload
    loads: list[LoadReport]
    spec: BenchSpecReport | None
    fit: ModelFitReport | None
    compare: list[tuple[str, Profile]]
    files: list[r.InputFile]


def read_inputs(config: ReportConfig) -> Inputs:
    profile_path = Path(config.profile) if config.profile else default_profile_path()
    profile = Profile.load(profile_path)
    files = [r.InputFile(name="profile", path=str(profile_path), created=timestamp(profile.created), status="read")]
    workload = load_workload(config.workload, profile.categories)
    files.append(r.InputFile(name="workload", path=config.workload, status="read"))
    policy = load_policy(config.policy) if config.policy else default_policy()
    how = "run `specroute bench load` against the service"
    loads = [_optional(p, "load", LoadReport, "bench load", how, files) for p in config.load_results or [None]]
    spec = _optional(config.bench_spec, "spec", BenchSpecReport, "bench spec", "run `specroute bench spec`", files)
    fit = _optional(
        config.model_fit, "fit", ModelFitReport, "bench model-fit", "run `specroute bench model-fit`", files
    )
    compare = _other_engine(profile, files) if config.other_engine and not config.profile else []
    for path in config.compare_profiles:
        other = Profile.load(Path(path))
        compare.append((path, other))
        files.append(r.InputFile(name="compare profile", path=path, created=timestamp(other.created), status="read"))
    return Inputs(profile, policy, workload, [x for x in loads if x is not None], spec, fit, compare, files)


def _other_engine(profile: Profile, files: list[r.InputFile]) -> list[tuple[str, Profile]]:
    """The embedded model's profile on the engine `profile` was not measured on (llama.cpp's of the
    file as shipped, or torch's float32), labelled by its engine, if this machine has one."""
    llamacpp = profile.model.engine == "llamacpp"
    path = default_profile_path() if llamacpp else default_profile_path(loop=LoopSettings(engine="llamacpp"))
    name = "torch" if llamacpp else "llama.cpp"
    if not path.is_file():
        how = f"run `specroute profile --engine {'torch' if llamacpp else 'llamacpp'}`"
        files.append(r.InputFile(name=f"{name} engine profile", path=None, status=f"missing: {how}"))
        return []
    other = Profile.load(path)
    files.append(
        r.InputFile(name=f"{name} engine profile", path=str(path), created=timestamp(other.created), status="read")
    )
    return [(f"this machine on {name} ({other.model.served})", other)]


def _optional(
    given: str | None, key: str, model: type[BaseModel], name: str, how: str, files: list[r.InputFile]
) -> Any:
    """A bench's JSON: the given path (which must exist), else the bench's default output file in
    the current directory when there is one, else None and a 'missing' line saying how to get it."""
    path = Path(given) if given else Path(DEFAULT_INPUTS[key])
    if not path.is_file():
        if given:
            raise ReportError(f"{name} results {path}: no such file")
        files.append(r.InputFile(name=name, path=None, status=f"missing: {how} (or pass its JSON), or use --measure"))
        return None
    try:
        value = model.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValidationError) as exc:
        raise ReportError(f"{path} is not a {name} result this specroute reads: {first_line(exc)}") from None
    created = getattr(value, "started", None) or getattr(value, "profile_created", None)
    files.append(r.InputFile(name=name, path=str(path), created=created, status="read"))
    return value


def first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def timestamp(moment: datetime) -> str:
    return f"{moment:%Y-%m-%d %H:%M} UTC"
