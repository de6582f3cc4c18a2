"""`specroute bench load`: LLMPerf-style closed-loop load against a running specroute service.

At each concurrency level, `c` workers each send one streaming chat request after another, drawn
round-robin from the categorised prompt set, once with the router deciding ("auto") and once per
forced backend, in the same run. The table then shows, level by level, whether routing beats every
fixed choice or where a fixed backend would have served the load better."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import httpx2 as httpx  # the environment's httpx distribution (the API is httpx's)
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tqdm import tqdm

from backends.errors import UserError
from profiler.workloads import check_categories, load_prompt_set

Mode = Literal["auto", "speculative", "plain", "quantized"]
MODES: tuple[Mode, ...] = ("auto", "speculative", "plain", "quantized")
ROUTER: Mode = "auto"
# The router counts as worse than a fixed backend only below this ratio: a router that picks the
# same backend lands within a couple of percent of it either way, from run-to-run noise alone.
WORSE_BELOW = 0.98


class LoadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field("http://127.0.0.1:8000", description="base URL of the specroute service")
    api_key: str | None = Field(None, description="sent as a Bearer token when set")
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32], min_length=1)
    modes: list[Mode] = Field(default_factory=lambda: list(MODES), min_length=1)
    requests_per_level: int | None = Field(None, ge=1, description="per (mode, level); default max(8, 2 × c)")
    max_tokens: int = Field(64, ge=1, le=2048)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    categories: list[str] | None = Field(None, description="prompt categories in the mix (default: all)")
    slo_ttft_ms: float = Field(2000.0, gt=0)
    slo_tpot_ms: float = Field(250.0, gt=0)
    timeout_s: float = Field(300.0, gt=0, description="whole-request deadline, stream included")
    model: str | None = Field(None, description="model id to request (default: the first of GET /v1/models)")

    _known_categories = field_validator("categories")(check_categories)

    @model_validator(mode="after")
    def _consistent(self) -> LoadConfig:
        if self.concurrency != sorted(set(self.concurrency)):
            raise ValueError(f"concurrency must be strictly increasing (got {self.concurrency})")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must not repeat (got {self.modes})")
        return self

    def requests_at(self, concurrency: int) -> int:
        # At least two requests per worker, so every worker's second request meets a loaded server.
        return self.requests_per_level or max(8, 2 * concurrency)


class RequestRecord(BaseModel):
    mode: Mode
    concurrency: int
    category: str
    prompt_id: str
    start_s: float = Field(description="seconds after the start of its cell")
    ttft_ms: float | None = Field(description="to the first content token; None when none came")
    tpot_ms: float | None = Field(description="(end − first token) / (completion tokens − 1); None below 2 tokens")
    e2e_ms: float
    completion_tokens: int
    backend: str | None = Field(description="the backend that served it, as the service reported")
    route: dict[str, Any] | None = Field(description="the service's `specroute` object from the final chunk")
    error: str | None = None


class Percentiles(BaseModel):
    p50: float | None
    p90: float | None
    p99: float | None


class CellStats(BaseModel):
    mode: Mode
    concurrency: int
    requests: int
    errors: int
    error_rate: float
    wall_s: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    output_tokens_per_s: float = Field(description="completion tokens of successful requests / cell wall time")
    slo_met: int
    goodput_rps: float = Field(description="requests meeting both SLOs per wall second")
    served_by: dict[str, float] = Field(description="share of successful requests per backend")


class LevelSummary(BaseModel):
    concurrency: int
    best_tokens_mode: Mode
    best_goodput_mode: Mode
    best_fixed_tokens_mode: Mode | None = Field(description="None unless auto and a forced backend both ran")
    best_fixed_goodput_mode: Mode | None
    router_tokens_ratio: float | None = Field(description="router tok/s over the best fixed backend's")
    router_goodput_ratio: float | None = Field(description="None when no fixed backend met the SLO")
    router_worse: bool


class LoadReport(BaseModel):
    config: LoadConfig
    model: str
    started: str = Field(description="UTC, ISO 8601")
    cells: list[CellStats]
    levels: list[LevelSummary]
    records: list[RequestRecord]

    def cell(self, mode: Mode, concurrency: int) -> CellStats:
        return next(c for c in self.cells if c.mode == mode and c.concurrency == concurrency)


@dataclass(frozen=True)
class _Prompt:
    category: str
    id: str
    messages: list[dict[str, Any]]


class _StreamError(Exception):
    """The service answered, but not with a complete stream: an HTTP error, an error event, no [DONE]."""


async def run_load(config: LoadConfig, client: httpx.AsyncClient | None = None, progress: bool = True) -> LoadReport:
    own_client = client is None
    # A connection per worker: a smaller pool would queue requests in this client, and the wait
    # would be charged to the service's TTFT.
    limits = httpx.Limits(max_connections=max(config.concurrency), max_keepalive_connections=max(config.concurrency))
    client = client or httpx.AsyncClient(timeout=config.timeout_s, limits=limits)
    try:
        model = await _check_service(client, config)
        started = datetime.now(UTC).isoformat(timespec="seconds")
        cells, records = await _run_schedule(client, config, model, progress)
    finally:
        if own_client:
            await client.aclose()
    cells.sort(key=lambda c: (c.concurrency, config.modes.index(c.mode)))
    levels = [_level_summary(c, [s for s in cells if s.concurrency == c]) for c in config.concurrency]
    return LoadReport(config=config, model=model, started=started, cells=cells, levels=levels, records=records)


async def _run_schedule(
    client: httpx.AsyncClient, config: LoadConfig, model: str, progress: bool
) -> tuple[list[CellStats], list[RequestRecord]]:
    prompts = _prompt_mix(config.categories)
    schedule = _schedule(config)
    cells, records = [], []
    # The project's imports bring torch, and a full collection over its objects pauses this client
    # for ~100 ms: time the service would be charged for. Frozen objects are never scanned.
    gc.collect()
    gc.freeze()
    try:
        total = sum(config.requests_at(c) for c, _ in schedule)
        with tqdm(total=total, desc="bench load", unit="req", leave=False, disable=not progress) as bar:
            for concurrency, mode in schedule:
                cell_records, wall_s = await _run_cell(client, config, model, prompts, mode, concurrency, bar)
                records += cell_records
                cells.append(_cell_stats(config, mode, concurrency, cell_records, wall_s))
    finally:
        gc.unfreeze()
    return cells, records


def _headers(config: LoadConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def _url(config: LoadConfig, path: str) -> str:
    return config.url.rstrip("/") + path


async def _check_service(client: httpx.AsyncClient, config: LoadConfig) -> str:
    """The model id to request; a clear error before any load when nothing answers."""
    try:
        health = await client.get(_url(config, "/healthz"), headers=_headers(config), timeout=10.0)
        models = await client.get(_url(config, "/v1/models"), headers=_headers(config), timeout=10.0)
    except httpx.HTTPError as exc:
        raise UserError(f"no specroute service at {config.url}: start one with `specroute serve` ({exc})") from exc
    for response in (health, models):
        if response.status_code != 200:
            raise UserError(
                f"the service at {config.url} answered {response.request.url.path} with HTTP "
                f"{response.status_code}: {_error_message(response)}"
            )
    served = [m["id"] for m in models.json().get("data", [])]
    if not served:
        raise UserError(f"the service at {config.url} lists no models at /v1/models")
    if config.model is not None and config.model not in served:
        raise UserError(f"model {config.model!r} is not served at {config.url} (it serves {', '.join(served)})")
    return config.model or served[0]


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase


def _prompt_mix(categories: list[str] | None) -> list[_Prompt]:
    """Categories interleaved (chat, code, …, chat, code, …), so even a short cell sees every kind."""
    known = load_prompt_set().categories
    chosen = {name: known[name] for name in categories or known}
    rounds = itertools.zip_longest(*(c.prompts for c in chosen.values()))
    return [
        _Prompt(name, p.id, [m.model_dump() for m in p.messages])
        for row in rounds
        for name, p in zip(chosen, row, strict=True)
        if p is not None
    ]


def _schedule(config: LoadConfig) -> list[tuple[int, Mode]]:
    """Levels in order; the mode order rotates from level to level, so no mode always runs first
    (cold caches) or last (a warm, possibly throttled machine)."""
    modes = config.modes
    return [(c, modes[(i + j) % len(modes)]) for i, c in enumerate(config.concurrency) for j in range(len(modes))]


async def _run_cell(
    client: httpx.AsyncClient,
    config: LoadConfig,
    model: str,
    prompts: list[_Prompt],
    mode: Mode,
    concurrency: int,
    bar: tqdm,
) -> tuple[list[RequestRecord], float]:
    """`concurrency` workers in a closed loop until the cell's requests are sent. Every cell starts
    at the same prompt, so the modes of one level serve the same requests."""
    total = config.requests_at(concurrency)
    tickets = iter(range(total))  # shared: each worker takes the next request when its last one ends
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def worker() -> None:
        for index in tickets:
            prompt = prompts[index % len(prompts)]
            records.append(await _timed_request(client, config, model, prompt, (mode, concurrency), start))
            bar.update()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


@dataclass
class _Trace:
    """What one streamed response told us, with the time each part arrived."""

    started: float
    first_token: float | None = None
    ended: float | None = None
    content_chunks: int = 0
    completion_tokens: int | None = None
    route: dict[str, Any] | None = None
    error: str | None = None

    def chunk(self, payload: Any) -> None:
        if not isinstance(payload, dict):
            raise _StreamError(f"unexpected event {payload!r:.200}")
        if "error" in payload:  # a failure after the 200 was sent comes in-band
            error = payload["error"]
            raise _StreamError(f"error event: {error.get('message') if isinstance(error, dict) else error}")
        for choice in payload.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                self.first_token = self.first_token or time.perf_counter()
                self.content_chunks += 1
        if payload.get("usage"):
            self.completion_tokens = int(payload["usage"]["completion_tokens"])
        if payload.get("specroute"):
            self.route = payload["specroute"]

    def record(self, prompt: _Prompt, cell: tuple[Mode, int], cell_start: float) -> RequestRecord:
        end = self.ended or time.perf_counter()
        # Without a usage chunk, content chunks are the best count of tokens there is.
        tokens = self.completion_tokens if self.completion_tokens is not None else self.content_chunks
        ok = self.error is None
        ttft = (self.first_token - self.started) * 1e3 if ok and self.first_token else None
        tpot = (end - self.first_token) * 1e3 / (tokens - 1) if ttft is not None and tokens > 1 else None
        return RequestRecord(
            mode=cell[0],
            concurrency=cell[1],
            category=prompt.category,
            prompt_id=prompt.id,
            start_s=self.started - cell_start,
            ttft_ms=ttft,
            tpot_ms=tpot,
            e2e_ms=(end - self.started) * 1e3,
            completion_tokens=tokens if ok else 0,
            backend=(self.route or {}).get("backend"),
            route=self.route,
            error=self.error,
        )


async def _timed_request(
    client: httpx.AsyncClient,
    config: LoadConfig,
    model: str,
    prompt: _Prompt,
    cell: tuple[Mode, int],
    cell_start: float,
) -> RequestRecord:
    """One streamed request, timed; any failure becomes the record's error, never the run's."""
    body = {
        "model": model,
        "messages": prompt.messages,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "specroute": {"backend": cell[0], "category": prompt.category},
    }
    trace = _Trace(started=time.perf_counter())
    try:
        # httpx's timeout bounds each read; this bounds the whole request, however slowly it streams.
        async with asyncio.timeout(config.timeout_s):
            await _stream(client, config, body, trace)
    except TimeoutError:
        trace.error = f"timeout after {config.timeout_s:g} s"
    except (httpx.HTTPError, _StreamError, ValueError) as exc:  # ValueError: a malformed JSON event
        trace.error = str(exc) if isinstance(exc, _StreamError) else f"{type(exc).__name__}: {exc}"
    return trace.record(prompt, cell, cell_start)


async def _stream(client: httpx.AsyncClient, config: LoadConfig, body: dict[str, Any], trace: _Trace) -> None:
    url = _url(config, "/v1/chat/completions")
    async with client.stream("POST", url, json=body, headers=_headers(config)) as response:
        if response.status_code >= 400:
            await response.aread()
            raise _StreamError(f"HTTP {response.status_code}: {_error_message(response)}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments and keep-alives
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                trace.ended = time.perf_counter()
                return
            trace.chunk(json.loads(data))
    raise _StreamError("stream ended before `data: [DONE]`")


def _percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(p50=None, p90=None, p99=None)
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return Percentiles(p50=p50, p90=p90, p99=p99)


def _meets_slo(config: LoadConfig, record: RequestRecord) -> bool:
    if record.error is not None:
        return False
    # A stream that never produced content made its client wait its whole length for nothing.
    ttft = record.ttft_ms if record.ttft_ms is not None else record.e2e_ms
    return ttft <= config.slo_ttft_ms and (record.tpot_ms is None or record.tpot_ms <= config.slo_tpot_ms)


def _cell_stats(
    config: LoadConfig, mode: Mode, concurrency: int, records: list[RequestRecord], wall_s: float
) -> CellStats:
    ok = [r for r in records if r.error is None]
    met = sum(_meets_slo(config, r) for r in records)
    backends = Counter(r.backend or "unknown" for r in ok)
    return CellStats(
        mode=mode,
        concurrency=concurrency,
        requests=len(records),
        errors=len(records) - len(ok),
        error_rate=(len(records) - len(ok)) / len(records),
        wall_s=wall_s,
        ttft_ms=_percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        tpot_ms=_percentiles([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        e2e_ms=_percentiles([r.e2e_ms for r in ok]),
        output_tokens_per_s=sum(r.completion_tokens for r in ok) / wall_s,
        slo_met=met,
        goodput_rps=met / wall_s,
        served_by={name: n / len(ok) for name, n in backends.most_common()},
    )


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _level_summary(concurrency: int, cells: list[CellStats]) -> LevelSummary:
    best_tokens = max(cells, key=lambda c: c.output_tokens_per_s)
    best_goodput = max(cells, key=lambda c: c.goodput_rps)
    router = next((c for c in cells if c.mode == ROUTER), None)
    fixed = [c for c in cells if c.mode != ROUTER]
    if router is None or not fixed:
        return LevelSummary(
            concurrency=concurrency,
            best_tokens_mode=best_tokens.mode,
            best_goodput_mode=best_goodput.mode,
            best_fixed_tokens_mode=None,
            best_fixed_goodput_mode=None,
            router_tokens_ratio=None,
            router_goodput_ratio=None,
            router_worse=False,
        )
    fixed_tokens = max(fixed, key=lambda c: c.output_tokens_per_s)
    fixed_goodput = max(fixed, key=lambda c: c.goodput_rps)
    tokens_ratio = _ratio(router.output_tokens_per_s, fixed_tokens.output_tokens_per_s)
    goodput_ratio = _ratio(router.goodput_rps, fixed_goodput.goodput_rps)
    return LevelSummary(
        concurrency=concurrency,
        best_tokens_mode=best_tokens.mode,
        best_goodput_mode=best_goodput.mode,
        best_fixed_tokens_mode=fixed_tokens.mode,
        best_fixed_goodput_mode=fixed_goodput.mode,
        router_tokens_ratio=tokens_ratio,
        router_goodput_ratio=goodput_ratio,
        router_worse=any(r is not None and r < WORSE_BELOW for r in (tokens_ratio, goodput_ratio)),
    )


def _ms(p: Percentiles, digits: int = 0) -> str:
    if p.p50 is None or p.p99 is None:
        return "—"
    return f"{p.p50:.{digits}f} / {p.p99:.{digits}f}"


def _served(cell: CellStats) -> str:
    return " ".join(f"{name} {share:.0%}" for name, share in cell.served_by.items()) or "—"


HEADER = (
    f"  {'mode':<12} {'served by':<28} {'TTFT p50/p99':>15} {'TPOT p50/p99':>15} {'e2e p50/p99':>17} "
    f"{'tok/s':>8} {'goodput/s':>10} {'errors':>8}"
)


def _row(cell: CellStats) -> str:
    return (
        f"  {cell.mode:<12} {_served(cell):<28} {_ms(cell.ttft_ms):>15} {_ms(cell.tpot_ms, 1):>15} "
        f"{_ms(cell.e2e_ms):>17} {cell.output_tokens_per_s:8.1f} {cell.goodput_rps:10.2f} "
        f"{f'{cell.errors}/{cell.requests}':>8}"
    )


def _comparison(report: LoadReport, level: LevelSummary) -> list[str]:
    c = level.concurrency
    best = f"c={c}: best overall: tok/s {level.best_tokens_mode}, goodput {level.best_goodput_mode}"
    if level.best_fixed_tokens_mode is None or level.best_fixed_goodput_mode is None:
        return [f"{best}; router not compared (needs auto and a forced backend)"]
    router = report.cell(ROUTER, c)
    fixed = report.cell(level.best_fixed_tokens_mode, c)
    good = report.cell(level.best_fixed_goodput_mode, c)
    return [
        f"c={c}: best fixed {fixed.mode} {fixed.output_tokens_per_s:.1f} tok/s; "
        f"router {router.output_tokens_per_s:.1f} tok/s = {_times(level.router_tokens_ratio)}",
        f"c={c}: best fixed by goodput {good.mode} {good.goodput_rps:.2f}/s; "
        f"router {router.goodput_rps:.2f}/s = {_times(level.router_goodput_ratio)}",
        best,
    ]


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}×"


def _worse_line(report: LoadReport) -> str:
    if all(level.best_fixed_tokens_mode is None for level in report.levels):
        return "router vs fixed backends: not compared (run auto and at least one forced backend)"
    worse = []
    for level in (lv for lv in report.levels if lv.router_worse):
        metrics = [
            f"{name} {_times(ratio)}"
            for name, ratio in (("tok/s", level.router_tokens_ratio), ("goodput", level.router_goodput_ratio))
            if ratio is not None and ratio < WORSE_BELOW
        ]
        worse.append(f"c={level.concurrency} ({', '.join(metrics)})")
    within = f"(by more than {1 - WORSE_BELOW:.0%}) "
    return f"router worse than the best fixed backend {within}at: {', '.join(worse) or 'nowhere'}"


def render_load(report: LoadReport) -> str:
    cfg = report.config
    lines = [
        f"specroute bench load — {report.model} at {cfg.url}, started {report.started}",
        f"closed loop, {cfg.max_tokens} max tokens, SLO: TTFT ≤ {cfg.slo_ttft_ms:g} ms and "
        f"TPOT ≤ {cfg.slo_tpot_ms:g} ms; latencies in ms",
    ]
    for level in report.levels:
        cells = [c for c in report.cells if c.concurrency == level.concurrency]
        lines += ["", f"c={level.concurrency} ({cells[0].requests} requests per mode)", HEADER]
        lines += [_row(c) for c in cells]
        lines += ["  " + line for line in _comparison(report, level)]
    lines += ["", _worse_line(report)]
    return "\n".join(lines)
