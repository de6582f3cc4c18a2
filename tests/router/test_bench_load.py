"""`bench load` against a fake specroute service (httpx MockTransport): no server, no model. The fake
sleeps known times, so the measured latencies can be checked, and fails some requests on purpose."""

import asyncio
import json

import httpx2 as httpx
import pytest
from pydantic import ValidationError

from backends.errors import UserError
from router.bench_load import _schedule, run_load
from router.load_models import Level, LoadConfig
from router.load_report import CellStats, LoadReport, Percentiles, level_summary, render_load

MODEL = "SmolLM2-135M-Instruct"
TTFT_S = 0.02
TOKEN_S = 0.01
SLOW_TOKEN_S = 0.04  # chat prompts: over the test's TPOT SLO
TOKENS = 4
LEVELS = [1, 2, 4]


OUTSIDE_MS = 20.0  # what the fake service says its router and HTTP took before the backend's TTFT


class FakeService:
    """The HTTP contract of `specroute serve`, with fixed sleeps. Math prompts get an HTTP 500; QA
    streams are cut before [DONE]; auto routes code to speculative and the rest to plain."""

    def __init__(self, health: dict | None = None) -> None:
        self.in_flight = 0
        self.arrivals: list[tuple[str, int]] = []  # (mode, requests in flight including this one)
        self.batching: list[str] = []
        self.auth: set[str | None] = set()
        self.health = health or {"status": "ok"}
        self.cut, self.fail = {"qa"}, {"math"}
        self.bodies: list[dict] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        self.auth.add(request.headers.get("authorization"))
        if request.url.path == "/healthz":
            return httpx.Response(200, json=self.health)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        assert request.url.path == "/v1/chat/completions"
        body = json.loads(request.content)
        self.bodies.append(body)
        assert body["model"] == MODEL and body["stream"] and body["stream_options"] == {"include_usage": True}
        self.in_flight += 1
        self.arrivals.append((body["specroute"]["backend"], self.in_flight))
        self.batching.append(body["specroute"]["batching"])
        if body["specroute"]["category"] in self.fail:
            self.in_flight -= 1
            error = {"message": "injected failure", "type": "server_error", "param": None, "code": 500}
            return httpx.Response(500, json={"error": error})
        return httpx.Response(200, content=self.stream(body), headers={"content-type": "text/event-stream"})

    async def stream(self, body: dict):
        mode, category = body["specroute"]["backend"], body["specroute"]["category"]
        backend = mode if mode != "auto" else ("speculative" if category == "code" else "plain")
        await asyncio.sleep(TTFT_S)
        for i in range(TOKENS):
            if i:
                await asyncio.sleep(SLOW_TOKEN_S if category == "chat" else TOKEN_S)
            yield event({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
            if category in self.cut:
                self.in_flight -= 1
                return  # cut: no usage, no [DONE]
        route = {"backend": backend, "drafter": None, "k": None, "stage": "test", "reasons": [], "retried": False}
        route["ttft_ms"] = TTFT_S * 1e3 - OUTSIDE_MS  # the backend's own count starts once the request reached it
        usage = {
            "prompt_tokens": 10,
            "completion_tokens": TOKENS,
            "total_tokens": 10 + TOKENS,
            "prompt_tokens_details": {"cached_tokens": 4},
        }
        self.in_flight -= 1  # before [DONE]: the client may start its next request as soon as it reads it
        yield event({"object": "chat.completion.chunk", "choices": [], "usage": usage, "specroute": route})
        yield b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def load(config: LoadConfig, handler) -> LoadReport:
    async def go() -> LoadReport:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_load(config, client=client, progress=False)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def fake() -> FakeService:
    return FakeService()


@pytest.fixture(scope="module")
def config() -> LoadConfig:
    return LoadConfig(concurrency=LEVELS, api_key="secret", slo_ttft_ms=500, slo_tpot_ms=25)


@pytest.fixture(scope="module")
def report(fake: FakeService, config: LoadConfig) -> LoadReport:
    return load(config, fake.handler)


def test_every_mode_and_level_has_its_cell_with_the_right_counts(report, config):
    assert [(c.level.concurrency, c.mode) for c in report.cells] == [(c, m) for c in LEVELS for m in config.modes]
    for cell in report.cells:
        assert cell.requests == config.requests_at(cell.level) == 8
        in_cell = [r for r in report.records if (r.mode, r.level) == (cell.mode, cell.level)]
        assert len(in_cell) == 8
        # Round-robin over the categories: the first 8 prompts are one of each of the 7, then chat again.
        assert sorted(r.category for r in in_cell) == sorted(["chat", "code", "summarization", "rag", "translation",
                                                              "math", "qa", "chat"])  # fmt: skip
    assert report.model == MODEL and {c.level.concurrency for c in report.levels} == set(LEVELS)


def test_closed_loop_never_exceeds_the_level_and_modes_rotate(report, fake, config):
    arrivals = iter(fake.arrivals)  # cells run one after another, in schedule order
    for scheduled in _schedule(config):
        cell = [next(arrivals) for _ in range(config.requests_at(scheduled.level))]
        assert {m for m, _ in cell} == {scheduled.mode}
        assert max(n for _, n in cell) == scheduled.level.concurrency  # reached, never exceeded
    assert next(arrivals, None) is None
    first_per_level = [_schedule(config)[i * len(config.modes)].mode for i in range(len(LEVELS))]
    assert len(set(first_per_level)) == len(LEVELS)
    # every cell its own prefix-cache salt (no mode finds what an earlier cell prefilled), every run new ones
    salts = [c.cache_salt for c in _schedule(config)]
    assert len(set(salts)) == len(salts) and not set(salts) & {c.cache_salt for c in _schedule(config)}
    bodies, sent = iter(fake.bodies), []
    for scheduled in _schedule(config):
        sent.append({next(bodies)["cache_salt"] for _ in range(config.requests_at(scheduled.level))})
    assert all(len(cell) == 1 for cell in sent) and len(set().union(*sent)) == len(sent)


def test_errors_are_counted_and_the_run_goes_on(report):
    for cell in report.cells:
        assert cell.errors == 2 and cell.error_rate == pytest.approx(2 / 8)
    errors = [r.error for r in report.records if r.error]
    assert any("HTTP 500: injected failure" in e for e in errors)
    assert any("before `data: [DONE]`" in e for e in errors)
    assert all(r.ttft_ms is None and r.completion_tokens == 0 for r in report.records if r.error)


def test_latencies_match_the_fake_sleeps(report):
    ok = [r for r in report.records if r.error is None]
    for r in ok:
        assert TTFT_S * 1e3 <= r.ttft_ms < TTFT_S * 1e3 + 150
        slow = r.category == "chat"
        low = (SLOW_TOKEN_S if slow else TOKEN_S) * 1e3
        assert low * 0.9 <= r.tpot_ms < low + 40
        assert r.completion_tokens == TOKENS and r.e2e_ms >= r.ttft_ms
    for cell in report.cells:
        assert cell.ttft_ms.p50 <= cell.ttft_ms.p90 <= cell.ttft_ms.p99
        assert cell.output_tokens_per_s == pytest.approx(6 * TOKENS / cell.wall_s)


def test_served_by_comes_from_the_final_chunk(report):
    for cell in report.cells:
        if cell.mode == "auto":
            # 6 successes: one code prompt routed to speculative, the rest to plain.
            assert cell.served_by == pytest.approx({"plain": 5 / 6, "speculative": 1 / 6})
        else:
            assert cell.served_by == {cell.mode: 1.0}
    assert all(r.route["stage"] == "test" for r in report.records if r.error is None)


def test_goodput_counts_only_requests_meeting_the_slo(report):
    for cell in report.cells:
        # 8 requests: 2 errors, 2 chat prompts over the 25 ms TPOT SLO, 4 within it.
        assert cell.slo_met == 4
        assert cell.goodput_rps == pytest.approx(4 / cell.wall_s)


def test_the_report_round_trips_as_json_and_carries_the_api_key(report, fake):
    assert LoadReport.model_validate_json(report.model_dump_json()) == report
    assert fake.auth == {"Bearer secret"}


def test_render_has_a_row_per_mode_and_the_router_comparison(report):
    text = render_load(report)
    for level in LEVELS:
        assert f"c={level} (8 requests per mode)" in text
        assert f"c={level}: best fixed " in text and f"c={level}: best overall: " in text
    assert text.count("  auto ") == len(LEVELS)
    assert "router worse than the best fixed backend (by more than 2%) at: " in text
    # Each cell's row, under its level, carries that cell's measured numbers.
    sections = {s.split(" ", 1)[0]: s.splitlines() for s in text.split("\n\n")}
    for cell in report.cells:
        [row] = [r for r in sections[f"c={cell.level.concurrency}"] if r.split()[:2] == [cell.mode, cell.batching]]
        assert f" {cell.ttft_ms.p50:.0f} / {cell.ttft_ms.p99:.0f} " in row
        assert f" {cell.tpot_ms.p50:.1f} / {cell.tpot_ms.p99:.1f} " in row
        tail = [f"{cell.output_tokens_per_s:.1f}", f"{cell.goodput_rps:.2f}", "2/8", "40%", f"{cell.outside_ms:.0f}"]
        assert row.split()[-6:-1] == tail  # the cached share: 4 of 10 prompt tokens, as the usage chunks said
        if cell.mode == "auto":  # 5 of the 6 answered requests went to plain
            assert "plain 83%" in row and "speculative 17%" in row
        else:
            assert f" {cell.mode} 100% " in row


def cell(mode: str, tokens_per_s: float, goodput: float, concurrency: int = 8, batching="continuous") -> CellStats:
    p = Percentiles(p50=10.0, p90=20.0, p99=30.0)
    return CellStats(
        mode=mode,
        batching=batching,
        level=Level(concurrency=concurrency),
        requests=16,
        errors=0,
        error_rate=0.0,
        wall_s=1.0,
        ttft_ms=p,
        tpot_ms=p,
        e2e_ms=p,
        output_tokens_per_s=tokens_per_s,
        slo_met=int(goodput),
        goodput_rps=goodput,
        served_by={"plain" if mode == "auto" else mode: 1.0},
    )


def test_router_worse_than_a_fixed_backend_is_called_out():
    cells = [cell("auto", 39.0, 3.5), cell("speculative", 30.0, 3.0), cell("plain", 41.2, 4.0)]
    cells += [cell("auto", 50.0, 5.0, 16), cell("plain", 45.0, 4.0, 16)]
    levels = [level_summary(cells[:3]), level_summary(cells[3:])]
    assert levels[0].best_tokens_mode == "plain" and levels[0].router_tokens_ratio == pytest.approx(39 / 41.2)
    assert levels[0].router_worse and not levels[1].router_worse
    config = LoadConfig(concurrency=[8, 16], modes=["auto", "speculative", "plain"])
    report = LoadReport(config=config, model=MODEL, started="now", cells=cells, levels=levels, records=[])
    text = render_load(report)
    assert "c=8: best fixed plain 41.2 tok/s; router 39.0 tok/s = 0.95×" in text
    assert "c=8: best fixed by goodput plain 4.00/s; router 3.50/s = 0.88×" in text
    assert "c=8: best overall: tok/s plain, goodput plain" in text
    assert "router worse than the best fixed backend (by more than 2%) at: c=8 (tok/s 0.95×, goodput 0.88×)" in text
    only_router = [level_summary([cell("auto", 39.0, 4.0)])]
    report = report.model_copy(update={"cells": cells[:1], "levels": only_router})
    assert "router vs fixed backends: not compared" in render_load(report)


def test_config_defaults():
    config = LoadConfig()
    assert config.concurrency == [1, 2, 4, 8, 16, 32] and config.modes == ["auto", "speculative", "plain", "quantized"]
    assert (config.requests_at(1), config.requests_at(16)) == (8, 32)
    assert LoadConfig(requests_per_level=3).requests_at(32) == 3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"concurrency": [2, 1]}, "strictly increasing"),
        ({"concurrency": [1, 1]}, "strictly increasing"),
        ({"concurrency": [0, 1]}, "greater than or equal to 1"),
        ({"modes": ["auto", "plain", "auto"]}, "must not repeat"),
        ({"modes": ["fast"]}, "literal_error"),
        ({"categories": ["chat", "poetry"]}, "unknown categories ['poetry']"),
        ({"max_tokens": 0}, "greater than or equal to 1"),
        ({"threads": 4}, "extra"),
    ],
)
def test_config_validation(fields, message):
    with pytest.raises(ValidationError) as info:
        LoadConfig(**fields)
    assert message in str(info.value) or message in repr(info.value.errors())


def test_categories_narrow_the_mix():
    fake = FakeService()
    config = LoadConfig(concurrency=[2], modes=["plain"], categories=["code"], requests_per_level=3)
    report = load(config, fake.handler)
    assert {r.category for r in report.records} == {"code"}
    assert [r.prompt_id for r in report.records] != [] and report.cells[0].errors == 0


def test_unreachable_service_is_a_user_error():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(UserError, match=r"no specroute service at http://127\.0\.0\.1:8000: start one with `spec"):
        load(LoadConfig(), refuse)
    # Without an injected client: a real connection to a port nothing listens on.
    with pytest.raises(UserError, match="no specroute service at http://127.0.0.1:9"):
        asyncio.run(run_load(LoadConfig(url="http://127.0.0.1:9"), progress=False))


def test_unhealthy_service_and_unknown_model_are_user_errors():
    def unhealthy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "backends loading", "type": "unavailable"}})

    with pytest.raises(UserError, match="/healthz with HTTP 503: backends loading"):
        load(LoadConfig(), unhealthy)
    with pytest.raises(UserError, match="model 'other' is not served"):
        load(LoadConfig(model="other"), FakeService().handler)


def test_an_in_band_error_event_is_an_error():
    fake = FakeService()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/chat/completions":
            return await fake.handler(request)
        failure = {"error": {"message": "the request failed mid-stream (RuntimeError)", "type": "server_error"}}
        return httpx.Response(200, content=event(failure) + b"data: [DONE]\n\n")

    report = load(LoadConfig(concurrency=[1], modes=["auto"], requests_per_level=2), handler)
    assert report.cells[0].errors == 2 and report.cells[0].served_by == {}
    assert report.records[0].error == "error event: the request failed mid-stream (RuntimeError)"


def test_an_open_loop_sends_at_poisson_times_without_waiting_for_answers():
    fake = FakeService()
    config = LoadConfig(request_rates=[40.0], modes=["plain"], requests_per_level=20, seed=3)
    report = load(config, fake.handler)
    starts = sorted(r.start_s for r in report.records)
    assert len(starts) == 20 and report.cells[0].level == Level(request_rate=40.0)
    assert max(n for _, n in fake.arrivals) > 1  # arrivals overlapped: nobody waited for an answer
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert 0.3 / 40 < sum(gaps) / len(gaps) < 3 / 40  # about the rate asked for
    again = load(config, FakeService().handler)
    # the same seed, the same arrival times (up to when the event loop got to send each one)
    assert all(abs(a.start_s - b.start_s) < 0.05 for a, b in zip(again.records, report.records, strict=True))
    text = render_load(report)
    assert "open loop (Poisson arrivals)" in text and "rate=40/s (20 requests per mode)" in text
    assert LoadConfig(request_rates=[2.0]).requests_at(Level(request_rate=2.0)) == 40


def test_the_batching_ab_runs_every_cell_both_ways_and_compares_them():
    fake = FakeService()
    config = LoadConfig(concurrency=[2], modes=["auto", "plain"], batching=["static", "continuous"])
    report = load(config, fake.handler)
    assert sorted((c.mode, c.batching) for c in report.cells) == [
        ("auto", "continuous"), ("auto", "static"), ("plain", "continuous"), ("plain", "static")
    ]  # fmt: skip
    assert sorted(set(fake.batching)) == ["continuous", "static"] and len(fake.batching) == 4 * 8
    assert {(c.mode, c.level.concurrency) for c in report.batching} == {("auto", 2), ("plain", 2)}
    assert all(c.tokens_ratio is not None and c.tokens_ratio > 0 for c in report.batching)
    assert len(report.levels) == 2  # the router is compared within each batching
    assert "step loop (continuous) over the static baseline" in render_load(report)


def test_the_router_is_compared_with_every_backend_and_judged_against_those_meeting_the_floor():
    cells = [cell("auto", 30.0, 3.0), cell("plain", 30.3, 3.0), cell("quantized", 60.0, 6.0)]
    summary = level_summary(cells, below_floor=["quantized"])
    assert summary.best_fixed_tokens_mode == "plain" and not summary.router_worse
    assert summary.router_vs == pytest.approx({"plain": 30 / 30.3, "quantized": 0.5})
    unfloored = level_summary(cells)
    assert unfloored.best_fixed_tokens_mode == "quantized" and unfloored.router_worse
    config = LoadConfig(concurrency=[8], modes=["auto", "plain", "quantized"])
    report = LoadReport(
        config=config, model=MODEL, started="now", below_quality_floor=["quantized"], cells=cells,
        levels=[summary], records=[],
    )  # fmt: skip
    text = render_load(report)
    assert "router tok/s over each fixed backend: plain 0.99× (1.00× goodput), quantized 0.50× (0.50× goodput)" in text
    assert "not counting quantized (under the quality floor)) at: nowhere" in text


def test_the_join_probe_times_a_short_request_arriving_while_a_long_one_decodes():
    fake = FakeService(health={"status": "ok", "below_quality_floor": ["quantized"]})
    fake.cut = set()
    config = LoadConfig(concurrency=[1], modes=["auto", "plain"], requests_per_level=1, join_probe=True)
    report = load(config, fake.handler)
    assert report.below_quality_floor == ["quantized"]
    (probe,) = report.join
    assert probe.mode == "plain" and probe.error is None and probe.same_text
    assert probe.idle_ttft_ms is not None and probe.joined_ttft_ms is not None
    assert probe.ttft_ratio == pytest.approx(probe.joined_ttft_ms / probe.idle_ttft_ms)
    assert max(n for _, n in fake.arrivals[-4:]) == 2  # the short one arrived while the long one ran
    assert "join probe:" in render_load(report) and "same text" in render_load(report)


def test_a_shared_prefix_workload_puts_one_document_before_every_prompt_and_reports_the_cached_share():
    fake = FakeService()
    config = LoadConfig(concurrency=[2], modes=["plain"], categories=["chat", "code"], workload="shared-prefix")
    report = load(config, fake.handler)
    systems = {json.dumps(b["messages"][0]) for b in fake.bodies}
    assert len(systems) == 1 and json.loads(systems.pop())["role"] == "system"
    assert len({b["cache_salt"] for b in fake.bodies}) == 1  # one cell: its requests share their cache
    assert all(b["messages"][1:] and b["messages"][-1]["role"] == "user" for b in fake.bodies)
    assert [c.cached_share for c in report.cells] == [0.4]  # 4 of 10 prompt tokens, as the usage said
    assert "workload shared-prefix" in render_load(report) and " 40%" in render_load(report)
    (outside,) = [c.outside_ms for c in report.cells]
    assert OUTSIDE_MS <= outside < OUTSIDE_MS + 150  # the client's TTFT less the backend's
    assert f"{outside:.0f} ms" in render_load(report)


def test_a_multi_turn_client_carries_its_history_and_starts_over_after_the_last_turn():
    fake = FakeService()
    config = LoadConfig(
        concurrency=[1], modes=["plain"], categories=["chat", "code"], workload="multi-turn", requests_per_level=6
    )
    load(config, fake.handler)
    roles = [[m["role"] for m in b["messages"] if m["role"] != "system"] for b in fake.bodies]
    turn = ["user", "assistant"]
    assert roles == [
        ["user"], [*turn, "user"], [*turn, *turn, "user"], [*turn, *turn, *turn, "user"], ["user"], [*turn, "user"]
    ]  # fmt: skip
    second = fake.bodies[1]["messages"]
    assert second[:-1] == [*fake.bodies[0]["messages"], {"role": "assistant", "content": "t0 t1 t2 t3 "}]
    with pytest.raises(ValidationError, match="multi-turn needs closed-loop clients"):
        LoadConfig(request_rates=[1.0], workload="multi-turn")
