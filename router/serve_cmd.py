"""`specroute serve`: start a local Ray instance and the Serve application on the embedded default,
wait until the real route answers, print the URL, and shut everything down on Ctrl-C or SIGTERM.

Serve first, measure while serving: on a machine with no profile, a quick probe (`quick_config`:
every pass the backends run timed once, for the dtype choice and the policy) comes first, its
profile marked provisional; the full `specroute profile` measurement then runs in a child process
that is paused (SIGSTOP) whenever a request is in flight and resumed once the service has been
idle a moment, so it measures between requests; when it is done the finished profile is written
where the provisional one was and the Router's `user_config` points at it (a reconfigure: no
replica restarts). Until then every decision says it uses a provisional profile, and each
backend's step loop times its own passes and chooses k from what it measures.

Ray on a small machine: the object store is kept small, Ray's files go to a temporary directory
of our own, token authentication keeps Ray's default (on for a new local cluster, the token in
~/.ray/auth_token; `RAY_AUTH_MODE` decides otherwise), Ray is told the machine's real core count,
and each backend replica runs its own capped number of torch threads (Ray starts replicas with
one).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.engines.llamacpp import llama_unavailable
from backends.errors import UserError
from policies.profile import Profile, ProfileError
from policies.serving_dtype import DEFAULT_DTYPE, SERVED_DTYPES
from profiler.hardware import NO_FAST_BF16, fast_reduced_precision

from .service import ServiceSettings, check_profile, resolve_dtype

if TYPE_CHECKING:
    from profiler.profiling import ProfileConfig

READY_TIMEOUT_S = 600.0
APP_NAME = "specroute"
OBJECT_STORE_BYTES = 256 * 1024**2
POLL_S = 0.1  # how often the loop asks the Router whether requests are in flight while a profile is measured
IDLE_BEFORE_RESUME_S = 1.0  # the service idle this long before the background profiler runs again
IN_FLIGHT_TIMEOUT_S = 2.0


def ensure_profiles(settings: ServiceSettings, log: Callable[[str], None] = print, probe: bool = False) -> list[Path]:
    """Every profile the service may route with, measured now (with progress) if missing, in full or,
    with `probe`, by a quick probe (provisional): with dtype auto, float32 and — where this machine
    runs bfloat16 natively — bfloat16, so that `resolve_dtype` can pick the faster exact one; else
    the one dtype asked for."""
    b = settings.backend
    if b.engine == "auto" and not settings.profile:  # both engines' profiles, for `resolve_dtype` to compare
        paths = ensure_profiles(settings.with_engine("torch"), log, probe)
        why = llama_unavailable()
        if why is None:
            return [*paths, *ensure_profiles(settings.with_engine("llamacpp"), log, probe)]
        log(f"llama.cpp not profiled: {why}")
        return paths
    paths = [ensure_profile(settings, log, probe=probe)]
    if settings.profile or b.dtype != "auto" or b.engine != "torch":  # llama.cpp's passes run no torch dtype
        return paths
    for dtype in SERVED_DTYPES:
        if dtype == DEFAULT_DTYPE:
            continue
        if fast_reduced_precision(b.device):
            paths.append(ensure_profile(settings.with_dtype(dtype), log, quantized_from=paths[0], probe=probe))
        else:
            log(f"{dtype} not profiled: {NO_FAST_BF16}; serving {DEFAULT_DTYPE}")
    return paths


def ensure_profile(
    settings: ServiceSettings,
    log: Callable[[str], None] = print,
    quantized_from: Path | None = None,
    probe: bool = False,
) -> Path:
    """The profile the service routes with; measured now (with progress) if there is none — with
    `probe`, a quick probe (`quick_config`) whose profile is provisional. `quantized_from`: a
    float32 profile whose quantized measurements this one takes instead of measuring its own (the
    quantized backend runs float32 kernels whatever the others run in). Undecided (auto), it is the
    reference dtype's."""
    if settings.backend.dtype == "auto":
        settings = settings.with_dtype(DEFAULT_DTYPE)
    path = settings.profile_path()
    if path.exists():
        return path
    from profiler.profiling import quick_config, run_profile

    config = profile_config(settings, quantized_from)
    if probe:
        log(f"no profile at {path}: a quick probe of this machine first; the full profile is measured while serving")
        config = quick_config(config)
    else:
        log(f"no profile at {path}: measuring this machine first (once)")
    profile = run_profile(config, progress=True, log=log)
    with_quantized(profile, quantized_from).save(path)
    log(f"{'provisional profile' if probe else 'profile'} written to {path}")
    return path


def profile_config(settings: ServiceSettings, quantized_from: Path | None = None) -> ProfileConfig:
    """The full measurement of what the backends will run, in the settings' (decided) dtype."""
    from profiler.profiling import ProfileConfig, batches_up_to

    b = settings.backend
    return ProfileConfig(
        model=b.model,
        dtype=b.dtype,
        device=b.device,
        threads=b.threads,
        drafters=b.drafters,
        drafter=b.drafter,
        batches=batches_up_to(b.max_batch),  # the largest batch a replica will run
        quantization=[] if quantized_from or b.engine != "torch" else [b.quantization],
        engine=b.engine,
        gguf_weights=b.gguf_weights,
        gguf_quantized=[] if quantized_from or b.engine != "llamacpp" else [b.quantized_weights],
        quantized_drafters=b.quantized_drafters,
    )


def with_quantized(profile: Profile, quantized_from: Path | None) -> Profile:
    """The profile with the quantized measurements of the profile at `quantized_from` (if given)."""
    if quantized_from is None:
        return profile
    source = Profile.load(quantized_from)
    return profile.model_copy(update={"quantized": source.quantized, "quantized_others": source.quantized_others})


@dataclass(frozen=True)
class ProfileJob:
    """One full measurement that replaces a provisional profile."""

    config: ProfileConfig
    path: Path
    quantized_from: Path | None = None


def completion_jobs(settings: ServiceSettings, paths: list[Path]) -> list[ProfileJob]:
    """The full measurements of the provisional profiles among `paths` (as `ensure_profiles`
    returns them: float32 first, whose quantized measurements the others take), in that order.
    `settings`: as asked for, before `resolve_dtype` (each engine's profile then gets that engine's
    default drafters unless some were named; decided settings carry the chosen engine's)."""
    jobs = []
    for i, path in enumerate(paths):
        profile = Profile.load(path)
        if profile.provisional:
            engine = profile.model.engine
            # a reduced-precision torch profile takes the float32 one's quantized backend (it runs float32 kernels)
            source = paths[0] if i and engine == "torch" else None
            config = profile_config(settings.with_engine(engine).with_dtype(profile.model.dtype), source)
            jobs.append(ProfileJob(config, path, source))
    return jobs


class BackgroundProfile:
    """The full profiles measured one after another, each in a child process that `poll` pauses
    (SIGSTOP) while requests are in flight and resumes (SIGCONT) once the service has been idle for
    IDLE_BEFORE_RESUME_S: on a small machine a profiler beside a request would slow the request
    down, and its own timings with it. A pass the pause or a request cut into only reads slower,
    and the profiler keeps the fastest of its tries; the context curve's time budget is read on a
    clock that stands still while paused."""

    def __init__(
        self, jobs: list[ProfileJob], log: Callable[[str], None] = print, measure: Callable[..., None] | None = None
    ):
        """`measure`: what the child runs (default: `_measure_full`; tests give a stand-in)."""
        self.jobs, self.log, self.measure = list(jobs), log, measure or _measure_full
        self.context = multiprocessing.get_context("spawn")  # a fresh interpreter: no Ray, no threads inherited
        self.process: multiprocessing.process.BaseProcess | None = None
        self.job: ProfileJob | None = None
        self.paused_s = self.context.RawValue("d", 0.0)  # seconds the running child spent stopped
        self.stopped_at: float | None = None
        self.idle_since: float | None = None
        self.started_at = time.monotonic()

    @property
    def done(self) -> bool:
        return self.process is None and not self.jobs

    def poll(self, busy: bool) -> ProfileJob | None:
        """Pause or resume the running measurement for `busy`; start the next when one ends. The
        job whose profile was just finished, if one was."""
        finished = self._reap()
        if self.process is None and self.jobs:
            self._start(self.jobs.pop(0))
        now = time.monotonic()
        if busy:
            self.idle_since = None
            self._pause(now)
        else:
            self.idle_since = self.idle_since or now
            if now - self.idle_since >= IDLE_BEFORE_RESUME_S:
                self._resume(now)
        return finished

    def stop(self) -> None:
        """End the running child (a stopped one is continued first so it can exit)."""
        process, self.jobs = self.process, []
        self.process = None
        if process is None or not process.is_alive():
            return
        process.terminate()
        _signal(process, signal.SIGCONT)
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)

    def _start(self, job: ProfileJob) -> None:
        log_path = job.path.with_suffix(".log")
        self.paused_s.value, self.stopped_at, self.job = 0.0, None, job
        self.process = self.context.Process(
            target=self.measure,
            args=(job.config.model_dump_json(), str(job.path), job.quantized_from, str(log_path), self.paused_s),
            name="specroute-profile",
            daemon=True,
        )
        self.process.start()
        self.started_at = time.monotonic()
        self.log(
            f"measuring the full {job.config.dtype} profile in the background, paused while requests are in "
            f"flight (progress: {log_path})"
        )

    def _reap(self) -> ProfileJob | None:
        process, job = self.process, self.job
        if process is None or process.is_alive() or job is None:
            return None
        self.process = self.job = None
        if process.exitcode != 0 or not _finished(job.path):
            log_path = job.path.with_suffix(".log")
            self.log(f"the full {job.config.dtype} profile failed (exit {process.exitcode}; see {log_path})")
            return None
        took, paused = time.monotonic() - self.started_at, self.paused_s.value
        self.log(
            f"full {job.config.dtype} profile written to {job.path} after {took / 60:.1f} min "
            f"({paused / 60:.1f} min of it paused for requests)"
        )
        return job

    def _pause(self, now: float) -> None:
        if self.process is not None and self.stopped_at is None:
            _signal(self.process, signal.SIGSTOP)
            self.stopped_at = now

    def _resume(self, now: float) -> None:
        if self.process is not None and self.stopped_at is not None:
            self.paused_s.value += now - self.stopped_at  # before the child runs again and reads its clock
            self.stopped_at = None
            _signal(self.process, signal.SIGCONT)


def _finished(path: Path) -> bool:
    try:
        return not Profile.load(path).provisional
    except ProfileError:
        return False


def _signal(process: multiprocessing.process.BaseProcess, signum: int) -> None:
    if process.pid is not None:
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:  # it has just ended
            pass


def _measure_full(config_json: str, path: str, quantized_from: Path | None, log_path: str, paused_s: Any) -> None:
    """The child: one full profile, its output to `log_path`, written where the provisional one is."""
    _end_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent ends this child
    with open(log_path, "w", encoding="utf-8") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    from profiler.profiling import ProfileConfig, run_profile

    config = ProfileConfig.model_validate_json(config_json)
    profile = run_profile(config, progress=True, clock=lambda: time.perf_counter() - paused_s.value)
    with_quantized(profile, quantized_from).save(Path(path))
    print(f"full profile written to {path}")


def _end_with_parent() -> None:
    """Linux: this process gets SIGKILL when the one that started it dies, so a killed service
    leaves no profiler behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_ray(num_cpus: int | None = None, metrics_export_port: int | None = None) -> str:
    """A local Ray instance for the service; Ray exports its metrics on `metrics_export_port`
    (default: a free port — `ray_metrics_url` says which)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="specroute-ray-")  # short: Ray's socket paths must fit 107 bytes
    ray.init(
        num_cpus=num_cpus or os.cpu_count() or 1,
        _metrics_export_port=metrics_export_port or free_port(),
        include_dashboard=False,
        object_store_memory=OBJECT_STORE_BYTES,
        _temp_dir=temp_dir,
        configure_logging=True,
        logging_level="WARNING",
        log_to_driver=False,
    )
    return temp_dir


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ray_metrics_url() -> str:
    """Where this node's Ray exports Prometheus metrics (every replica's series, prefixed `ray_`)."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"] and n["NodeID"] == ray.get_runtime_context().get_node_id())
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def serve_config(
    settings: ServiceSettings, policy: dict[str, Any] | None = None, profile: Path | None = None
) -> dict[str, Any]:
    """The Serve config `serve run deploy/serve.yaml` would apply, for these settings and policy;
    `profile`: a profile file the Router switches to (a finished one replacing the provisional
    profile it started with — the same application otherwise, so Serve reconfigures in place)."""
    app: dict[str, Any] = {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": "router.service:app_builder",
        "args": settings.model_dump(mode="json"),
    }
    user_config = {"policy": policy} if policy is not None else {}
    if profile is not None:
        user_config["profile"] = str(profile)
    if user_config:
        app["deployments"] = [{"name": "Router", "user_config": user_config}]
    return {"applications": [app]}


def deploy(settings: ServiceSettings, host: str, port: int, policy: dict[str, Any] | None = None) -> str:
    """Start Serve on host:port and apply the application's config — the path `serve run` and
    `serve deploy` take, so a later config differing only in the policy reconfigures in place.
    Return the base URL once the app answers."""
    start_serve(host, port)
    apply_config(serve_config(settings, policy))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    wait_ready(url)
    return url


def start_serve(host: str, port: int) -> None:
    from ray.serve._private.api import serve_start  # what `serve run <config>` starts Serve with

    serve_start(http_options={"host": host, "port": port})


def apply_config(config: dict[str, Any]) -> None:
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))


def wait_ready(url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll /healthz until the app itself answers (Serve's proxy says 404 until the route exists);
    stop at once if Serve reports the application failed to deploy."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        _raise_if_failed()
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.5)
    raise UserError(f"the service did not become ready within {timeout_s:.0f} s ({last})")


def _raise_if_failed() -> None:
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is not None and str(app.status).endswith("DEPLOY_FAILED"):
        raise UserError(f"the service failed to start: {app.message}")


def serve_forever(settings: ServiceSettings, host: str, port: int, policy_file: str | None = None) -> int:
    from backends.embedded import prepare_embedded_model
    from policies.config import load_policy

    # A bad policy or model is refused here, before Ray starts.
    config = load_policy(policy_file) if policy_file else None
    policy = config.model_dump(mode="json") if config else None
    if settings.backend.model in ("embedded", "default"):
        prepare_embedded_model()
    paths = ensure_profiles(settings, probe=True)
    jobs = completion_jobs(settings, paths)
    settings = resolve_dtype(settings, config)
    print(f"serving in {settings.backend.dtype}: {settings.dtype_choice.reason}", flush=True)  # type: ignore[union-attr]
    check_profile(settings, config)
    temp_dir = start_ray()
    stop = _stop_on_signals()  # after ray.init, which installs handlers of its own
    background = BackgroundProfile(jobs, log=lambda line: print(line, flush=True))
    try:
        print(f"starting specroute on {host}:{port} (loading the backends takes a minute)…", flush=True)
        url = deploy(settings, host, port, policy)
        print(f"specroute is serving at {url}/v1 (OpenAI-compatible; /healthz, /v1/advise). Ctrl-C stops it.")
        print(f"metrics: {url}/metrics (Prometheus text format: the router and each backend's step loop)")
        print(f"         {ray_metrics_url()} (Ray's export: every replica's series, prefixed ray_)", flush=True)
        served, busy = settings.profile_path(), router_busy()
        while not stop():
            if background.done:
                time.sleep(0.5)
                continue
            finished = background.poll(busy())
            if finished is not None and finished.path == served:
                apply_config(serve_config(settings, policy, profile=served))
                print("the service now routes with the full profile", flush=True)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        pass
    finally:
        background.stop()
        shutdown(temp_dir)
        print("specroute stopped")
    return 0


def router_busy() -> Callable[[], bool]:
    """Whether the Router has requests in flight, asked through its handle (when it cannot say, it
    counts as busy: a profiler must not compete with requests nobody can see)."""
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)

    def busy() -> bool:
        try:
            return handle.in_flight.remote().result(timeout_s=IN_FLIGHT_TIMEOUT_S) > 0
        except Exception:
            return True

    return busy


def shutdown(temp_dir: str | None = None) -> None:
    """Stop Serve and Ray; remove Ray's session files if they are ours."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_on_signals() -> Callable[[], bool]:
    stopped = [False]

    def handler(signum: int, _frame: object) -> None:
        stopped[0] = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return lambda: stopped[0]
