"""Benchmark results the docs quote, each with where it came from: `docs/results/<name>.json` holds
one run as `{"kind", "provenance", "result"}` — the bench's own JSON untouched under `result`, and
beside it the command that produced it, the CPU it ran on, when, and the git revision it ran at.

The provenance is taken around the run itself (`record_run` runs the command), never typed in
afterwards: a number in the docs can always be traced to the exact command, machine and code."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from policies.errors import UserError

PROGRAM = "specroute"
REDACTED = "<redacted>"
SECRET_FLAGS = ("--api-key",)  # their values never reach a results file
SECRET_KEYS = ("api_key",)


class ResultError(UserError):
    """A run that cannot be recorded; the message says why."""


class Provenance(BaseModel):
    """Where one result came from."""

    model_config = ConfigDict(extra="forbid")

    command: str = Field(description="the command as run (program name without its directory, secrets redacted)")
    cpu: str = Field(description="CPU model name, as /proc/cpuinfo gives it")
    logical_cores: int = Field(description="logical cores of the machine (not the threads the run used)")
    cuda_device: str | None = Field(None, description="the GPU torch saw, if any")
    load_average: float | None = Field(
        None, description="1-minute load average as the command started: above logical_cores, the machine was busy"
    )
    started: str = Field(description="UTC, ISO 8601, when the command started")
    finished: str = Field(description="UTC, ISO 8601, when it ended")
    revision: str = Field(description="git commit the working tree was at")
    dirty: bool = Field(description="the working tree had uncommitted changes (the revision alone does not give it)")

    @property
    def date(self) -> str:
        return self.started[:10]


class ResultFile(BaseModel):
    """One file of docs/results: the bench's JSON and its provenance."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(description="the command that produced it, e.g. 'bench plain' or 'report'")
    provenance: Provenance
    result: dict[str, Any]


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def command_line(argv: Sequence[str]) -> str:
    """The command as a reader would type it: `specroute ...` whatever directory it ran from, with
    the values of secret flags redacted."""
    words = list(argv)
    if words and Path(words[0]).name == PROGRAM:
        words[0] = PROGRAM
    for i, word in enumerate(words):
        if i and words[i - 1] in SECRET_FLAGS:
            words[i] = REDACTED
        elif word.startswith(tuple(flag + "=" for flag in SECRET_FLAGS)):
            words[i] = word.partition("=")[0] + "=" + REDACTED
    return shlex.join(words)


def redact(data: Any) -> Any:
    """`data` with the value of every secret key replaced (a bench's config echoes its API key)."""
    if isinstance(data, dict):
        return {k: REDACTED if k in SECRET_KEYS and v is not None else redact(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v) for v in data]
    return data


def git_state(root: Path) -> tuple[str, bool]:
    """The commit `root`'s checkout is at, and whether its tracked or untracked files differ from it."""
    revision = _git(root, "rev-parse", "HEAD").strip()
    return revision, bool(_git(root, "status", "--porcelain").strip())


def _git(root: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ResultError(f"git {' '.join(args)} failed in {root}: a result needs the revision it ran at") from exc
    return done.stdout


def provenance(argv: Sequence[str], started: str, git: tuple[str, bool], load: float | None) -> Provenance:
    """The provenance of a run of `argv` that began at `started`, with the checkout then in `git`
    (read before the run: the run's own output files must not count as changes) and the load
    average then (`load`: what else the machine was doing)."""
    from .hardware import machine_info  # torch: only where a result is recorded

    machine = machine_info()
    return Provenance(
        command=command_line(argv),
        cpu=machine.cpu,
        logical_cores=machine.logical_cores,
        cuda_device=machine.cuda_device,
        load_average=load,
        started=started,
        finished=now(),
        revision=git[0],
        dirty=git[1],
    )


def record_run(
    argv: Sequence[str],
    kind: str,
    read_result: Callable[[subprocess.CompletedProcess[str]], dict[str, Any]],
    root: Path,
    capture: bool,
) -> ResultFile:
    """Runs `argv` (stdout captured when `capture`, stderr shown), then wraps what `read_result`
    finds in its provenance. A failed run records nothing."""
    started, git, load = now(), git_state(root), _load_average()
    try:
        done = subprocess.run(list(argv), stdout=subprocess.PIPE if capture else None, text=True)
    except OSError as exc:
        raise ResultError(f"`{command_line(argv)}` could not start ({exc}): is the venv's bin on PATH?") from None
    if done.returncode != 0:
        raise ResultError(f"`{command_line(argv)}` exited with {done.returncode}: nothing recorded")
    return ResultFile(kind=kind, provenance=provenance(argv, started, git, load), result=redact(read_result(done)))


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not every platform has one
        return None
