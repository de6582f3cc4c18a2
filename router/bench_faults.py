"""`specroute bench faults`: faults under load, measured.

The bench starts its own service (local Ray and Serve, as `specroute serve` does) and runs one
fixed list of requests twice in a closed loop: undisturbed, then while faults fire in turn — a
SIGKILL of the speculative, then the plain, then the quantized backend's replica process, and an
invalid routing policy deployed (then the good one restored). Each fault fires once enough requests
have completed and the previous fault has recovered, so every window holds one fault.
`router.fault_models` computes the figures from the records.

Requests cycle through the held-out prompt set, and their kinds alternate streaming/non-streaming ×
greedy/sampled (seeded), so every fault meets every kind and the greedy answers of the two runs can
be compared request by request. They go to the router ("auto"), or with `routes` in turn also to
forced backends: the router may send a backend nothing at a given load, and its kill would then
meet no request in flight.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import httpx2 as httpx  # the environment's httpx distribution (the API is httpx's)
from tqdm import tqdm

from backends.errors import UserError

from .bench_load import Prompt, StreamError, Trace, check_service, error_message, prompt_mix
from .fault_models import (
    BAD_POLICY,
    FaultEvent,
    FaultName,
    FaultRequestRecord,
    FaultsConfig,
    FaultsReport,
    Outcome,
    Phase,
    Route,
    build_report,
)
from .load_models import LoadConfig

if TYPE_CHECKING:
    from .service import ServiceSettings

# The @serve.deployment names in backends/deployments.py.
DEPLOYMENTS = {"speculative": "SpeculativeBackend", "plain": "PlainBackend", "quantized": "QuantizedBackend"}
# streaming, greedy — in turn, so neighbours in the closed loop differ in kind.
KINDS = [(True, True), (False, True), (True, False), (False, False)]
PROBE_MESSAGES = [{"role": "user", "content": "Say OK."}]


class ServiceControl(Protocol):
    """The service under test and the faults it can be given."""

    url: str
    categories: list[str]  # prompt categories the profile knows: sent as hints
    weights: str  # the dtype the exact backends serve

    def kill(self, backend: str) -> int: ...  # SIGKILL the backend's replica; its pid
    def apply_policy(self, policy: dict[str, Any] | None) -> None: ...  # None: the good one again


@dataclass(frozen=True)
class Planned:
    index: int
    prompt: Prompt
    stream: bool
    greedy: bool
    route: Route = "auto"


@dataclass
class Run:
    """One run of the request list; times are seconds after `start`."""

    phase: Phase
    start: float = field(default_factory=time.perf_counter)
    records: list[FaultRequestRecord] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def now(self) -> float:
        return time.perf_counter() - self.start


def plan_requests(count: int, prompts: list[Prompt], routes: list[Route] | None = None) -> list[Planned]:
    """Prompts round-robin; kinds in turn; routes in turn per block of kinds, so every route meets every kind."""
    routes = routes or ["auto"]
    return [
        Planned(i, prompts[i % len(prompts)], *KINDS[i % len(KINDS)], routes[i // len(KINDS) % len(routes)])
        for i in range(count)
    ]


def request_body(planned: Planned, model: str, config: FaultsConfig, categories: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {"backend": planned.route}
    if planned.prompt.category in categories:  # a hint the profile can use; others would be refused
        options["category"] = planned.prompt.category
    body: dict[str, Any] = {
        "model": model,
        "messages": planned.prompt.messages,
        "max_tokens": config.max_tokens,
        "temperature": 0.0 if planned.greedy else config.sampled_temperature,
        "stream": planned.stream,
        "specroute": options,
    }
    if not planned.greedy:
        body["seed"] = config.seed + planned.index
    if planned.stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Answer:
    """What came back for one request."""

    outcome: Outcome = "lost"
    status: int | None = None
    error: str | None = None
    text: str = ""
    tokens: int = 0
    route: dict[str, Any] | None = None


def outcome_of(status: int) -> Outcome:
    if status == 429:
        return "overloaded"
    return "server_error" if status >= 500 else "client_error" if status >= 400 else "ok"


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout_s: float) -> Answer:
    """One request; every failure becomes the answer's outcome, never the run's."""
    answer = Answer()
    try:
        async with asyncio.timeout(timeout_s):  # httpx bounds each read; this bounds the whole request
            await (_stream if body["stream"] else _post)(client, url + "/v1/chat/completions", body, answer)
    except TimeoutError:
        answer.outcome, answer.error = "lost", f"timeout after {timeout_s:g} s"
    except (httpx.HTTPError, ValueError, LookupError, TypeError) as exc:  # no response, or a malformed one
        answer.outcome, answer.error = "lost", f"{type(exc).__name__}: {exc}"
    return answer


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any], answer: Answer) -> None:
    response = await client.post(url, json=body)
    answer.status = response.status_code
    if response.status_code >= 400:
        answer.outcome, answer.error = outcome_of(response.status_code), error_message(response)
        return
    payload = response.json()
    answer.text = payload["choices"][0]["message"]["content"]
    answer.tokens = int(payload["usage"]["completion_tokens"])
    answer.route, answer.outcome = payload.get("specroute"), "ok"


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], answer: Answer) -> None:
    """`bench load`'s event parsing, keeping the status: an error status is not a lost request."""
    trace = Trace(started=time.perf_counter())
    async with client.stream("POST", url, json=body) as response:
        answer.status = response.status_code
        if response.status_code >= 400:
            await response.aread()
            answer.outcome, answer.error = outcome_of(response.status_code), error_message(response)
            return
        try:
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                if data == "[DONE]":
                    answer.text, answer.route, answer.outcome = trace.text, trace.route, "ok"
                    answer.tokens = trace.completion_tokens or trace.content_chunks
                    return
                if data is not None:
                    trace.chunk(json.loads(data))
        except StreamError as exc:  # an error event after the 200: the server gave up on it
            answer.outcome, answer.error = "server_error", str(exc)
            return
    answer.error = "stream ended before `data: [DONE]`"


async def timed(
    client: httpx.AsyncClient, service: ServiceControl, model: str, config: FaultsConfig, planned: Planned, *, run: Run
) -> FaultRequestRecord:
    start = run.now()
    answer = await send(client, service.url, request_body(planned, model, config, service.categories), config.timeout_s)
    route = answer.route or {}
    return FaultRequestRecord(
        index=planned.index,
        phase=run.phase,
        category=planned.prompt.category,
        prompt_id=planned.prompt.id,
        route=planned.route,
        stream=planned.stream,
        greedy=planned.greedy,
        start_s=start,
        end_s=run.now(),
        outcome=answer.outcome,
        status=answer.status,
        error=answer.error,
        text=answer.text,
        completion_tokens=answer.tokens,
        backend=route.get("backend"),
        weights=route.get("weights"),
        retried=route.get("retried"),
    )


async def run_closed_loop(
    plan: list[Planned], concurrency: int, one: Callable[[Planned], Awaitable[FaultRequestRecord]], run: Run, bar: tqdm
) -> float:
    """`concurrency` clients, each sending the next request of the plan when its last one ends; the wall seconds."""
    tickets = iter(plan)  # shared

    async def client() -> None:
        for planned in tickets:
            run.records.append(await one(planned))
            bar.update()

    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        run.finished.set()
    return run.now()


# -- faults -------------------------------------------------------------------------------------


async def poll_until(check: Callable[[], Awaitable[bool]], interval_s: float, timeout_s: float) -> bool:
    """Whether `check` came true within `timeout_s` (a check still running at the deadline is cut)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            async with asyncio.timeout(left):
                if await check():
                    return True
        except TimeoutError:
            return False
        await asyncio.sleep(interval_s)
    return False


async def backend_serves(client: httpx.AsyncClient, url: str, model: str, backend: str) -> bool:
    """A one-token request forced to `backend` came back from it without a retry."""
    body = {"model": model, "messages": PROBE_MESSAGES, "max_tokens": 1, "temperature": 0.0}
    try:
        response = await client.post(url + "/v1/chat/completions", json={**body, "specroute": {"backend": backend}})
        return response.status_code == 200 and response.json()["specroute"]["retried"] is False
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False


async def health(client: httpx.AsyncClient, url: str) -> tuple[int, dict[str, Any]]:
    """/healthz's status and body; status 0 when it did not answer."""
    try:
        response = await client.get(url + "/healthz")
        return response.status_code, response.json()
    except (httpx.HTTPError, ValueError):
        return 0, {}


@dataclass
class Injector:
    client: httpx.AsyncClient
    service: ServiceControl
    model: str
    config: FaultsConfig

    async def kill(self, backend: FaultName, run: Run) -> FaultEvent:
        fired_after = len(run.records)
        pid = await asyncio.to_thread(self.service.kill, backend)  # a blocking Ray call: off the event loop
        fired = run.now()
        served = await self._poll(lambda: backend_serves(self.client, self.service.url, self.model, backend))
        return FaultEvent(
            fault=backend, fired_after=fired_after, fired_s=fired, pid=pid, recovered_s=run.now() if served else None
        )

    async def refuse_policy(self, run: Run) -> FaultEvent:
        """Deploy the invalid policy, wait for /healthz to show the refusal, hold it, restore the good one."""
        event = FaultEvent(fault="policy", fired_after=len(run.records), fired_s=run.now(), recovered_s=None)
        try:
            await asyncio.to_thread(self.service.apply_policy, BAD_POLICY)
            if await self._poll(self._shows_refusal(event)):
                event.refused_s = run.now()
            await asyncio.sleep(self.config.policy_hold_s)
        finally:  # whatever happened, the service gets its good policy back
            await asyncio.to_thread(self.service.apply_policy, None)
            event.restored_s = run.now()
        if await self._poll(self._healthy):
            event.recovered_s = run.now()
        return event

    def _shows_refusal(self, event: FaultEvent) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            status, body = await health(self.client, self.service.url)
            event.refused_status = status
            return bool(body.get("policy_error"))

        return check

    async def _healthy(self) -> bool:
        status, body = await health(self.client, self.service.url)
        return status == 200 and not body.get("policy_error")

    async def _poll(self, check: Callable[[], Awaitable[bool]]) -> bool:
        return await poll_until(check, self.config.probe_interval_s, self.config.recovery_timeout_s)

    async def drive(self, run: Run) -> list[FaultEvent]:
        """Each fault once `fire_after` requests completed and the last fault recovered; none after the run ends."""
        events: list[FaultEvent] = []
        for fault, after in zip(self.config.faults, self.config.fire_after(), strict=True):
            if not await _completed(run, after):
                break
            events.append(await (self.refuse_policy(run) if fault == "policy" else self.kill(fault, run)))
        return events


async def _completed(run: Run, count: int) -> bool:
    """Wait until `count` requests completed; False if the run finished first."""
    while len(run.records) < count:
        if run.finished.is_set():
            return False
        await asyncio.sleep(0.05)
    return True


# -- the bench ----------------------------------------------------------------------------------


async def measure(
    service: ServiceControl, config: FaultsConfig, client: httpx.AsyncClient | None = None, progress: bool = True
) -> FaultsReport:
    """Both runs against `service`; `client` for tests (default: one with a connection per client)."""
    most = config.concurrency + 4  # the clients, the probes and /healthz: none waits for a connection
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    own = httpx.AsyncClient(timeout=config.timeout_s, limits=limits) if client is None else nullcontext(client)
    async with own as http:
        model, _ = await check_service(http, LoadConfig(url=service.url))
        await _check_backends(http, service.url, model)
        plan = plan_requests(config.requests, prompt_mix(None, "heldout"), config.routes)
        started = datetime.now(UTC).isoformat(timespec="seconds")
        # A full collection over torch's objects pauses this client ~100 ms, charged to the service.
        gc.collect()
        gc.freeze()
        try:
            runs, events = await _both_runs(http, service, model, config, plan, progress)
        finally:
            gc.unfreeze()
    return build_report(config, model, service.weights, started, runs, events)


async def _both_runs(
    client: httpx.AsyncClient,
    service: ServiceControl,
    model: str,
    config: FaultsConfig,
    plan: list[Planned],
    progress: bool,
) -> tuple[dict[Phase, tuple[list[FaultRequestRecord], float]], list[FaultEvent]]:
    injector = Injector(client, service, model, config)

    async def one_run(phase: Phase) -> tuple[list[FaultRequestRecord], float, list[FaultEvent]]:
        run = Run(phase)
        send_one = partial(timed, client, service, model, config, run=run)
        with tqdm(total=len(plan), desc=f"bench faults: {phase}", unit="req", disable=not progress) as bar:
            load = run_closed_loop(plan, config.concurrency, send_one, run, bar)
            wall, events = await asyncio.gather(load, injector.drive(run)) if phase == "faulted" else (await load, [])
        return sorted(run.records, key=lambda r: r.index), wall, events

    undisturbed, undisturbed_wall, _ = await one_run("undisturbed")
    faulted, faulted_wall, events = await one_run("faulted")
    return {"undisturbed": (undisturbed, undisturbed_wall), "faulted": (faulted, faulted_wall)}, events


async def _check_backends(client: httpx.AsyncClient, url: str, model: str) -> None:
    """Every backend answers before the runs: a fault must meet a working service."""
    for backend in DEPLOYMENTS:
        if not await backend_serves(client, url, model, backend):
            raise UserError(f"the {backend} backend at {url} did not answer a one-token request: see the Serve logs")


# -- the service --------------------------------------------------------------------------------


@dataclass
class LocalService:
    """The service this bench started; kills and policies go through this process, Ray's driver."""

    url: str
    categories: list[str]
    weights: str
    settings: ServiceSettings
    policy: dict[str, Any]

    def kill(self, backend: str) -> int:
        pid = replica_pid(DEPLOYMENTS[backend])
        os.kill(pid, signal.SIGKILL)
        return pid

    def apply_policy(self, policy: dict[str, Any] | None) -> None:
        """Redeploy the same config with only the Router's user_config changed: a hot policy reload."""
        from .serve_cmd import apply_config, serve_config

        apply_config(serve_config(self.settings, policy if policy is not None else self.policy))


def replica_pid(deployment: str) -> int:
    """The process of the deployment's running replica, as Serve's controller knows it. (Ray's state
    API would need the dashboard's API server, which `start_ray` does not start.)"""
    from ray.serve.context import _get_global_client

    from .serve_cmd import APP_NAME

    details = _get_global_client().get_serve_details()
    replicas = details["applications"][APP_NAME]["deployments"][deployment]["replicas"]
    running = [r["pid"] for r in replicas if r["state"] == "RUNNING" and r.get("pid")]
    if not running:
        raise RuntimeError(f"{deployment} has no running replica to kill ({replicas})")
    return int(running[0])


@contextmanager
def local_service(config: FaultsConfig, log: Callable[[str], None] = print) -> Iterator[LocalService]:
    """What `specroute serve` starts with its defaults (profiling this machine first if needed),
    with the default policy given explicitly, so that restoring it after the invalid one is a
    reconfigure. Shut down on the way out."""
    from backends.embedded import prepare_embedded_model
    from policies.config import default_policy

    from .serve_cmd import deploy, ensure_profiles, shutdown, start_ray
    from .service import ServiceSettings, check_profile, resolve_dtype

    settings = ServiceSettings(profile=config.profile)
    policy = default_policy()
    prepare_embedded_model(log=log)
    ensure_profiles(settings, log)
    settings = resolve_dtype(settings, policy)
    profile = check_profile(settings)
    temp_dir = start_ray()
    try:
        log(f"starting the service on 127.0.0.1:{config.port} (loading the backends takes a minute)…")
        good = policy.model_dump(mode="json")
        url = deploy(settings, "127.0.0.1", config.port, good)
        yield LocalService(url, list(profile.categories), settings.backend.dtype, settings, good)
    finally:
        shutdown(temp_dir)


def run_faults(config: FaultsConfig, progress: bool = True, log: Callable[[str], None] = print) -> FaultsReport:
    with local_service(config, log) as service:
        return asyncio.run(measure(service, config, progress=progress))
