"""`specroute serve`: start a local Ray instance and the Serve application on the embedded default
(profiling this machine first when no profile exists), wait until the real route answers, print
the URL, and shut everything down on Ctrl-C or SIGTERM.

Ray on a small machine: the object store is kept small, Ray's files go to a temporary directory
of our own, token authentication keeps Ray's default (on for a new local cluster, the token in
~/.ray/auth_token; `RAY_AUTH_MODE` decides otherwise), Ray is told the machine's real core count,
and each backend replica runs its own capped number of torch threads (Ray starts replicas with
one).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends.errors import UserError
from policies.profile import Profile
from policies.serving_dtype import DEFAULT_DTYPE, SERVED_DTYPES
from profiler.hardware import NO_FAST_BF16, fast_reduced_precision

from .service import ServiceSettings, check_profile, resolve_dtype

READY_TIMEOUT_S = 600.0
APP_NAME = "specroute"
OBJECT_STORE_BYTES = 256 * 1024**2


def ensure_profiles(settings: ServiceSettings, log: Callable[[str], None] = print) -> list[Path]:
    """Every profile the service may route with, measured now (with progress) if missing: with
    dtype auto, float32 and — where this machine runs bfloat16 natively — bfloat16, so that
    `resolve_dtype` can pick the faster exact one; else the one dtype asked for."""
    b = settings.backend
    paths = [ensure_profile(settings, log)]
    if settings.profile or b.dtype != "auto":
        return paths
    for dtype in SERVED_DTYPES:
        if dtype == DEFAULT_DTYPE:
            continue
        if fast_reduced_precision(b.device):
            paths.append(ensure_profile(settings.with_dtype(dtype), log, quantized_from=paths[0]))
        else:
            log(f"{dtype} not profiled: {NO_FAST_BF16}; serving {DEFAULT_DTYPE}")
    return paths


def ensure_profile(
    settings: ServiceSettings, log: Callable[[str], None] = print, quantized_from: Path | None = None
) -> Path:
    """The profile the service routes with; measured now (with progress) if there is none.
    `quantized_from`: a float32 profile whose quantized measurements this one takes instead of
    measuring its own (the quantized backend runs float32 kernels whatever the others run in).
    Undecided (auto), it is the reference dtype's."""
    if settings.backend.dtype == "auto":
        settings = settings.with_dtype(DEFAULT_DTYPE)
    path = settings.profile_path()
    if path.exists():
        return path
    from profiler.profiling import ProfileConfig, batches_up_to, run_profile

    b = settings.backend
    log(f"no profile at {path}: measuring this machine first (once)")
    config = ProfileConfig(
        model=b.model,
        dtype=b.dtype,
        device=b.device,
        threads=b.threads,
        drafters=b.drafters,
        drafter=b.drafter,
        batches=batches_up_to(b.max_batch),  # the largest batch a replica will run
        quantization=[] if quantized_from else [b.quantization],
    )
    profile = run_profile(config, progress=True, log=log)
    if quantized_from is not None:
        source = Profile.load(quantized_from)
        profile = profile.model_copy(
            update={"quantized": source.quantized, "quantized_others": source.quantized_others}
        )
    profile.save(path)
    log(f"profile written to {path}")
    return path


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


def serve_config(settings: ServiceSettings, policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Serve config `serve run deploy/serve.yaml` would apply, for these settings and policy."""
    app: dict[str, Any] = {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": "router.service:app_builder",
        "args": settings.model_dump(mode="json"),
    }
    if policy is not None:
        app["deployments"] = [{"name": "Router", "user_config": {"policy": policy}}]
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
    ensure_profiles(settings)
    settings = resolve_dtype(settings, config)
    print(f"serving in {settings.backend.dtype}: {settings.dtype_choice.reason}", flush=True)  # type: ignore[union-attr]
    check_profile(settings)
    temp_dir = start_ray()
    stop = _stop_on_signals()  # after ray.init, which installs handlers of its own
    try:
        print(f"starting specroute on {host}:{port} (loading the backends takes a minute)…", flush=True)
        url = deploy(settings, host, port, policy)
        print(f"specroute is serving at {url}/v1 (OpenAI-compatible; /healthz, /v1/advise). Ctrl-C stops it.")
        print(f"metrics: {url}/metrics (Prometheus text format: the router and each backend's step loop)")
        print(f"         {ray_metrics_url()} (Ray's export: every replica's series, prefixed ray_)", flush=True)
        while not stop():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown(temp_dir)
        print("specroute stopped")
    return 0


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
