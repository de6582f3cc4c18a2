"""`bench faults`: the figures over synthetic records, the client's accounting of every kind of
answer, and the whole bench against a fake service whose backends go down when killed — no Ray,
no model."""

import asyncio
import json
import random

import httpx2 as httpx
import pytest
from pydantic import ValidationError

from router.bench_faults import KINDS, measure, plan_requests, request_body, send
from router.fault_models import (
    BAD_POLICY,
    FaultEvent,
    FaultRequestRecord,
    FaultsConfig,
    build_report,
    fault_figures,
    figures,
    greedy_comparison,
    in_window,
    render_faults,
)

MODEL = "SmolLM2-135M-Instruct"
URL = "http://fake"


def record(index: int, start: float, end: float, **fields) -> FaultRequestRecord:
    defaults = {
        "phase": "faulted",
        "category": "chat",
        "prompt_id": f"p{index}",
        "stream": index % 2 == 0,
        "greedy": True,
        "outcome": "ok",
        "status": 200,
        "text": f"answer {index}",
        "completion_tokens": 4,
        "backend": "plain",
        "weights": "float32",
        "retried": False,
    }
    return FaultRequestRecord(index=index, start_s=start, end_s=end, **{**defaults, **fields})


def undisturbed(records: list[FaultRequestRecord]) -> dict[int, FaultRequestRecord]:
    return {r.index: r.model_copy(update={"phase": "undisturbed"}) for r in records}


# -- figures --------------------------------------------------------------------------------------


def test_window_holds_requests_in_flight_or_started_between_fault_and_recovery():
    records = [
        record(0, 0.0, 0.9),  # finished before the fault
        record(1, 0.5, 1.5),  # in flight when it fired
        record(2, 1.2, 1.8),  # started and ended inside
        record(3, 1.9, 3.0),  # started before the recovery
        record(4, 2.1, 2.5),  # started after it
    ]
    assert [r.index for r in in_window(records, 1.0, 2.0)] == [1, 2, 3]


def test_every_request_counts_once_and_only_completed_ones_have_latency():
    records = [
        record(0, 0.0, 1.0),
        record(1, 0.0, 2.0, retried=True),
        record(2, 0.0, 9.0, outcome="lost", status=None, text=""),
        record(3, 0.0, 0.1, outcome="server_error", status=503, text=""),
        record(4, 0.0, 0.1, outcome="server_error", status=200, text=""),  # an error event mid-stream
        record(5, 0.0, 0.1, outcome="client_error", status=400, text=""),
        record(6, 0.0, 0.1, outcome="overloaded", status=429, text=""),
        record(7, 0.0, 3.0, greedy=False),
    ]
    f = figures(records, {})
    assert (f.requests, f.completed, f.lost, f.server_errors, f.client_errors, f.overloaded) == (8, 3, 1, 2, 1, 1)
    assert f.retried == 1 and f.sampled_completed == 1
    assert f.e2e_ms.p50 == pytest.approx(2000.0) and f.e2e_ms.p99 == pytest.approx(2980.0)  # of 1, 2 and 3 s


def test_greedy_outputs_compare_only_like_with_like():
    before = undisturbed([record(i, 0, 1) for i in range(5)])
    before[4] = before[4].model_copy(update={"outcome": "lost", "text": ""})
    assert greedy_comparison(record(0, 0, 1), before) == "same"
    assert greedy_comparison(record(1, 0, 1, text="another answer"), before) == "different"
    # The quantized model is another model: its greedy answer may differ with no fault at all.
    assert greedy_comparison(record(2, 0, 1, weights="int4-weight-only", text="x"), before) == "other-weights"
    assert greedy_comparison(record(3, 0, 1, greedy=False, text="x"), before) is None
    assert greedy_comparison(record(4, 0, 1), before) is None  # not completed undisturbed
    assert greedy_comparison(record(0, 0, 1, outcome="lost"), before) is None
    assert greedy_comparison(record(9, 0, 1), before) is None


def test_fault_figures_time_the_recovery_and_compare_the_same_requests_undisturbed():
    faulted = [record(i, float(i), i + 2.0, text="changed" if i == 3 else f"answer {i}") for i in range(10)]
    before = undisturbed([record(i, float(i), i + 0.5) for i in range(10)])
    event = FaultEvent(fault="plain", fired_after=3, fired_s=4.5, pid=42, recovered_s=6.0)
    f = fault_figures(event, faulted, before, run_end_s=12.0)
    assert f.recovery_s == pytest.approx(1.5) and f.window_s == (4.5, 6.0)
    assert f.figures.requests == 4  # 3, 4, 5, 6
    assert f.figures.greedy_differing == 1 and f.figures.greedy_compared == 4
    assert f.figures.e2e_ms.p99 == pytest.approx(2000.0) and f.undisturbed_e2e_ms.p99 == pytest.approx(500.0)


def test_an_unrecovered_fault_holds_its_window_open_to_the_end_of_the_run():
    faulted = [record(i, float(i), i + 1.0) for i in range(10)]
    event = FaultEvent(fault="quantized", fired_after=5, fired_s=5.5, pid=7, recovered_s=None)
    f = fault_figures(event, faulted, undisturbed(faulted), run_end_s=10.0)
    assert f.recovery_s is None and f.window_s == (5.5, 10.0) and f.figures.requests == 5


def test_report_lists_unfired_faults_differing_requests_and_what_lies_outside_the_windows():
    config = FaultsConfig(requests=10, faults=["speculative", "policy"])
    before = [record(i, float(i), i + 1.0, phase="undisturbed") for i in range(10)]
    after = [record(i, float(i), i + 1.0, text="x" if i in (2, 8) else f"answer {i}") for i in range(10)]
    event = FaultEvent(fault="speculative", fired_after=2, fired_s=2.5, pid=1, recovered_s=3.5)
    report = build_report(
        config, MODEL, "float32", "now", {"undisturbed": (before, 10), "faulted": (after, 11)}, [event]
    )
    assert report.not_fired == ["policy"] and report.differing == [2, 8]
    assert report.faulted.greedy_differing == 2 and report.faults[0].figures.greedy_differing == 1
    assert report.faults[0].figures.requests == 2  # 2 and 3
    assert report.outside_windows.requests == 8 and report.outside_windows.greedy_differing == 1  # 8: a control
    text = render_faults(report)
    assert "SIGKILL speculative (pid 1) @2" in text and "not fired" in text and "2 of 10 greedy" in text


def test_faults_fire_at_fixed_fractions_and_never_repeat():
    assert FaultsConfig().fire_after() == [150, 350, 550, 750]
    assert FaultsConfig(requests=24, faults=["plain"]).fire_after() == [4]
    with pytest.raises(ValidationError):
        FaultsConfig(faults=["plain", "plain"])
    with pytest.raises(ValidationError):
        FaultsConfig(faults=["router"])


# -- the client -----------------------------------------------------------------------------------


def sse(*payloads: dict, done: bool = True) -> bytes:
    body = b"".join(f"data: {json.dumps(p)}\n\n".encode() for p in payloads)
    return body + (b"data: [DONE]\n\n" if done else b"")


ROUTE = {"backend": "plain", "weights": "float32", "retried": False}
CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
ERROR = {"error": {"message": "the request failed mid-stream", "type": "server_error"}}
COMPLETION = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"completion_tokens": 1},
    "specroute": ROUTE,
}


def answer(response: httpx.Response | Exception, stream: bool):
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(response, Exception):
            raise response
        return response

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, URL, {"stream": stream}, timeout_s=5)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("response", "stream", "outcome", "status"),
    [
        (httpx.Response(200, content=sse(CHUNK, {"choices": [], "specroute": ROUTE})), True, "ok", 200),
        (httpx.Response(200, content=sse(CHUNK, ERROR)), True, "server_error", 200),
        (httpx.Response(200, content=sse(CHUNK, done=False)), True, "lost", 200),
        (httpx.Response(200, json=COMPLETION), False, "ok", 200),
        (httpx.Response(200, text="not json"), False, "lost", 200),
        (httpx.Response(503, json={"error": {"message": "no backend"}}), True, "server_error", 503),
        (httpx.Response(503, json={"error": {"message": "no backend"}}), False, "server_error", 503),
        (httpx.Response(429, json={"error": {"message": "busy"}}), False, "overloaded", 429),
        (httpx.Response(400, json={"error": {"message": "bad"}}), True, "client_error", 400),
        (httpx.ConnectError("refused"), False, "lost", None),
        (httpx.RemoteProtocolError("peer closed"), True, "lost", None),
    ],
)
def test_every_answer_gets_one_outcome_and_keeps_its_status(response, stream, outcome, status):
    got = answer(response, stream)
    assert (got.outcome, got.status) == (outcome, status)
    assert (got.text == "hi") == (outcome == "ok") and (got.error is None) == (outcome == "ok")
    if outcome == "ok":
        assert got.route == ROUTE


def test_routes_cycle_per_block_of_kinds_so_every_route_meets_every_kind():
    from router.bench_load import prompt_mix

    plan = plan_requests(32, prompt_mix(None, "heldout"), ["auto", "plain"])
    assert [p.route for p in plan[:12]] == ["auto"] * 4 + ["plain"] * 4 + ["auto"] * 4
    assert {(p.route, p.stream, p.greedy) for p in plan} == {(r, *k) for r in ("auto", "plain") for k in KINDS}
    assert request_body(plan[4], MODEL, FaultsConfig(), [])["specroute"] == {"backend": "plain"}
    with pytest.raises(ValidationError):
        FaultsConfig(routes=["auto", "auto"])


def test_requests_alternate_kinds_and_seed_the_sampled_ones_by_index():
    from router.bench_load import prompt_mix

    prompts = prompt_mix(None, "heldout")
    plan = plan_requests(10, prompts)
    assert [(p.stream, p.greedy) for p in plan[:4]] == KINDS and plan[4].prompt == prompts[4]
    config = FaultsConfig(seed=100, max_tokens=7)
    greedy, sampled = (request_body(plan[i], MODEL, config, ["chat"]) for i in (1, 2))
    assert greedy["temperature"] == 0 and "seed" not in greedy and not greedy["stream"]
    assert sampled["temperature"] == 0.8 and sampled["seed"] == 102 and sampled["stream_options"]["include_usage"]
    assert greedy["specroute"]["backend"] == "auto" and sampled["max_tokens"] == 7
    # Only categories the profile knows are sent as hints: the service refuses the others.
    assert [("category" in request_body(p, MODEL, config, ["chat"])["specroute"]) for p in plan[:2]] == [
        p.prompt.category == "chat" for p in plan[:2]
    ]


# -- the whole bench against a fake service -------------------------------------------------------


class FakeService:
    """`specroute serve`'s contract: a killed backend answers the next two probes forced to it with a
    retry, the router serves every other request (greedy answers depend on the prompt only), and
    the invalid policy shows on /healthz as a 503 until the good one is back."""

    url = URL
    categories = ["chat"]
    weights = "float32"

    def __init__(self) -> None:
        self.down: dict[str, int] = {}
        self.policy_error: str | None = None
        self.kills: list[str] = []
        self.policies: list[dict | None] = []

    def kill(self, backend: str) -> int:
        self.kills.append(backend)
        self.down[backend] = 2
        return 1000 + len(self.kills)

    def apply_policy(self, policy: dict | None) -> None:
        self.policies.append(policy)
        self.policy_error = "speculation.enabled: not a boolean" if policy == BAD_POLICY else None

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/healthz":
            status = 503 if self.policy_error else 200
            return httpx.Response(status, json={"status": "ok", "policy_error": self.policy_error})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL}]})
        body = json.loads(request.content)
        await asyncio.sleep(0.005)
        backend = body["specroute"]["backend"]
        retried = self.down.get(backend, 0) > 0
        self.down[backend] = max(0, self.down.get(backend, 0) - 1)
        text = body["messages"][-1]["content"][:12] if body["temperature"] == 0 else str(random.random())
        route = {"backend": "plain" if backend == "auto" else backend, "weights": "float32", "retried": retried}
        if not body.get("stream"):
            message = {"role": "assistant", "content": text}
            payload = {"choices": [{"message": message}], "usage": {"completion_tokens": 3}, "specroute": route}
            return httpx.Response(200, json=payload)
        usage = {"completion_tokens": 3}
        return httpx.Response(
            200, content=sse({"choices": [{"delta": {"content": text}}]}, {"usage": usage, "specroute": route})
        )


def test_faults_fire_in_turn_each_after_the_last_recovered_and_nothing_is_lost():
    fake = FakeService()
    config = FaultsConfig(requests=200, concurrency=4, probe_interval_s=0.01, policy_hold_s=0.0)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake.handler)) as client:
            return await measure(fake, config, client=client, progress=False)

    report = asyncio.run(go())
    assert fake.kills == ["speculative", "plain", "quantized"] and fake.policies == [BAD_POLICY, None]
    events = [f.event for f in report.faults]
    assert [e.fault for e in events] == ["speculative", "plain", "quantized", "policy"] and not report.not_fired
    assert all(e.fired_after >= after for e, after in zip(events, config.fire_after(), strict=True))
    assert all(a.recovered_s <= b.fired_s for a, b in zip(events, events[1:], strict=False))  # one fault at a time
    assert [e.pid for e in events[:3]] == [1001, 1002, 1003] and all(f.recovery_s > 0 for f in report.faults)
    policy = events[3]
    assert (
        policy.refused_status == 503 and policy.fired_s <= policy.refused_s <= policy.restored_s <= policy.recovered_s
    )
    f = report.faulted
    assert (f.requests, f.completed, f.lost, f.server_errors, f.greedy_differing) == (200, 200, 0, 0, 0)
    assert f.greedy_compared == 100 and f.sampled_completed == 100
    assert len(report.records) == 400 and report.wall_s["faulted"] > 0


# -- the real kill --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_replica_is_found_killed_and_serves_again_through_serve(service):
    """The bench's Ray side on the session's real service: the replica's pid from Serve's
    controller, a SIGKILL, and the recovery probe seeing a new replica answer without a retry."""
    from router.bench_faults import LocalService, backend_serves, poll_until, replica_pid
    from router.service import ServiceSettings
    from tests.router.conftest import POLICY, _settings

    settings = ServiceSettings.model_validate(_settings(service.profile))
    control = LocalService(service.url, [], "float32", settings, POLICY)

    async def recovered() -> bool:
        async with httpx.AsyncClient(timeout=60) as client:
            model = (await client.get(service.url + "/v1/models")).json()["data"][0]["id"]
            return await poll_until(lambda: backend_serves(client, service.url, model, "plain"), 0.5, 120)

    killed = control.kill("plain")
    assert asyncio.run(recovered())
    assert replica_pid("PlainBackend") != killed
