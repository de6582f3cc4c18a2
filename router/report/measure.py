"""`specroute report --measure`: run what the report found missing, with progress bars, and
point the report at the results. The profile is measured as the service's first start measures
it; `bench spec` and `bench model-fit` run in this process at a small size (a report needs their
shape, not their last digit); `bench load` needs the service, so it uses the one at `--url` or
starts `specroute serve` for the run and stops it after."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from policies.errors import UserError

from .inputs import DEFAULT_INPUTS, ReportConfig

SERVICE_START_S = 1800.0  # a first start profiles this machine (minutes) before it serves
MEASURE_LOAD = {"concurrency": [1, 2, 4, 8], "max_tokens": 48}
# The report reads model-fit's measured speedups, not its scoring of the α/ρ predictor.
MEASURE_FIT = {"batches": [1, 4, 16], "ks": [2, 4], "prompts_per_category": 1, "predictor_prompts": 0}
MEASURE_SPEC = {"prompts_per_category": 1, "transformers": False}


def measure_missing(config: ReportConfig, url: str, log: Callable[[str], None] = print) -> ReportConfig:
    """The config with every missing input measured into `config.out` and named. Everything runs on
    the embedded default model, as the service does; a report on another profile brings its own
    bench results. The load run uses the service at `url`, or starts one on `url`'s port."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    updates: dict[str, object] = {}
    if config.profile is None:
        _ensure_profile(log)
    if config.bench_spec is None and not Path(DEFAULT_INPUTS["spec"]).is_file():
        updates["bench_spec"] = _bench_spec(out / DEFAULT_INPUTS["spec"], log)
    if config.model_fit is None and not Path(DEFAULT_INPUTS["fit"]).is_file():
        updates["model_fit"] = _model_fit(out / DEFAULT_INPUTS["fit"], config.profile, log)
    if not config.load_results and not Path(DEFAULT_INPUTS["load"]).is_file():
        port = urllib.parse.urlsplit(url).port or 8000
        updates["load_results"] = [_bench_load(out / DEFAULT_INPUTS["load"], url, port, config.profile, log)]
    return config.model_copy(update=updates)


def _ensure_profile(log: Callable[[str], None]) -> None:
    from ..serve_cmd import ensure_profile
    from ..service import ServiceSettings

    ensure_profile(ServiceSettings(), log=log)


def _bench_spec(path: Path, log: Callable[[str], None]) -> str:
    from profiler.bench_spec import BenchSpecConfig, run_bench_spec

    log(f"measuring: bench spec ({MEASURE_SPEC})")
    path.write_text(run_bench_spec(BenchSpecConfig(**MEASURE_SPEC)).model_dump_json(indent=2))
    return str(path)


def _model_fit(path: Path, profile: str | None, log: Callable[[str], None]) -> str:
    from profiler.bench_model_fit import ModelFitConfig, run_model_fit

    log(f"measuring: bench model-fit ({MEASURE_FIT})")
    path.write_text(run_model_fit(ModelFitConfig(profile=profile, **MEASURE_FIT)).model_dump_json(indent=2))
    return str(path)


def _bench_load(path: Path, url: str, port: int, profile: str | None, log: Callable[[str], None]) -> str:
    from ..bench_load import run_load
    from ..load_models import LoadConfig

    service = None if _answers(url) else _start_service(port, profile, log)
    try:
        target = url if service is None else f"http://127.0.0.1:{port}"
        log(f"measuring: bench load at {target} ({MEASURE_LOAD})")
        report = asyncio.run(run_load(LoadConfig(url=target, **MEASURE_LOAD)))
    finally:
        if service is not None:
            _stop(service)
    path.write_text(report.model_dump_json(indent=2))
    return str(path)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/healthz", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _start_service(port: int, profile: str | None, log: Callable[[str], None]) -> subprocess.Popen:
    """`specroute serve` (on the report's profile) in its own process group, ready when its routes
    answer."""
    command = [sys.executable, "-m", "router.cli", "serve", "--port", str(port)]
    command += ["--profile", profile] if profile else []
    log(f"starting `specroute {' '.join(command[3:])}` for the load run (stopped after it)")
    service = subprocess.Popen(command, start_new_session=True)
    deadline = time.monotonic() + SERVICE_START_S
    while not _answers(f"http://127.0.0.1:{port}"):
        if service.poll() is not None:
            raise UserError(f"`specroute serve` exited with status {service.returncode} before it served")
        if time.monotonic() > deadline:
            _stop(service)
            raise UserError(f"`specroute serve` did not answer within {SERVICE_START_S:.0f} s")
        time.sleep(2)
    return service


def _stop(service: subprocess.Popen) -> None:
    """Ctrl-C for the whole group (serve shuts Ray down on it); a kill if it lingers."""
    try:
        os.killpg(service.pid, signal.SIGINT)
        service.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(service.pid, signal.SIGKILL)
        service.wait()
    except ProcessLookupError:
        pass
