"""`specroute bench load`: LLMPerf-style load against a running specroute service.

Each level is either a closed loop — `c` workers each send one streaming chat request after
another — or an open loop — requests arrive as a Poisson process at a fixed rate, whether or not
earlier ones finished, as vLLM's `bench serve` sends them. Prompts are drawn round-robin from the
categorised prompt set. At every level the router ("auto") and every forced backend run in the
same run, and with `batching` = both, every backend also runs through the static baseline (batches
decoded to completion) beside the step loop. `join` probes, per backend, how long a short request
waits for its first token when it arrives while a long one decodes, and whether it gets exactly
the text it gets alone. `router.load_report` turns the records into the tables."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import secrets
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import httpx2 as httpx  # the environment's httpx distribution (the API is httpx's)
import numpy as np
from tqdm import tqdm

from backends.errors import UserError
from profiler.workloads import PromptSetName, load_prompt_set

from .load_models import (
    JOIN_LONG_TOKENS,
    MULTI_TURN_TURNS,
    ROUTER,
    Cell,
    JoinProbe,
    Level,
    LoadConfig,
    RequestRecord,
)
from .load_report import LoadReport, build_report


@dataclass(frozen=True)
class Prompt:
    category: str
    id: str
    messages: list[dict[str, Any]]


class StreamError(Exception):
    """The service answered, but not with a complete stream: an HTTP error, an error event, no [DONE]."""


async def run_load(config: LoadConfig, client: httpx.AsyncClient | None = None, progress: bool = True) -> LoadReport:
    """Every cell of the schedule, then the join probe if asked."""
    own_client = client is None
    # A connection per client in flight: a smaller pool would queue requests in this client, and
    # the wait would be charged to the service's TTFT. An open loop has no bound.
    most = None if config.open_loop else max(config.concurrency)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    client = client or httpx.AsyncClient(timeout=config.timeout_s, limits=limits)
    try:
        model, health = await check_service(client, config)
        started = datetime.now(UTC).isoformat(timespec="seconds")
        records, walls = await _run_schedule(client, config, model, progress)
        join = await probe_joins(client, config, model) if config.join_probe else []
    finally:
        if own_client:
            await client.aclose()
    below = health.get("below_quality_floor") or []
    return build_report(config, model, started, records, walls, join, below)


async def _run_schedule(
    client: httpx.AsyncClient, config: LoadConfig, model: str, progress: bool
) -> tuple[list[RequestRecord], dict[Cell, float]]:
    prompts = prompt_mix(config.categories)
    if config.workload == "shared-prefix":
        prompts = with_shared_document(prompts)
    records: list[RequestRecord] = []
    walls: dict[Cell, float] = {}
    # The project's imports bring torch, and a full collection over its objects pauses this client
    # for ~100 ms: time the service would be charged for. Frozen objects are never scanned.
    gc.collect()
    gc.freeze()
    try:
        schedule = _schedule(config)
        total = sum(config.requests_at(c.level) for c in schedule)
        with tqdm(total=total, desc="bench load", unit="req", leave=False, disable=not progress) as bar:
            for cell in schedule:
                run = _run_open_cell if cell.level.request_rate is not None else _run_closed_cell
                cell_records, walls[cell] = await run(client, config, model, prompts, cell, bar)
                records += cell_records
    finally:
        gc.unfreeze()
    return records, walls


def _headers(config: LoadConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def _url(config: LoadConfig, path: str) -> str:
    return config.url.rstrip("/") + path


async def check_service(client: httpx.AsyncClient, config: LoadConfig) -> tuple[str, dict[str, Any]]:
    """The model id to request and the service's health; a clear error before any load when
    nothing answers."""
    try:
        health = await client.get(_url(config, "/healthz"), headers=_headers(config), timeout=10.0)
        models = await client.get(_url(config, "/v1/models"), headers=_headers(config), timeout=10.0)
    except httpx.HTTPError as exc:
        raise UserError(f"no specroute service at {config.url}: start one with `specroute serve` ({exc})") from exc
    for response in (health, models):
        if response.status_code != 200:
            raise UserError(
                f"the service at {config.url} answered {response.request.url.path} with HTTP "
                f"{response.status_code}: {error_message(response)}"
            )
    served = [m["id"] for m in models.json().get("data", [])]
    if not served:
        raise UserError(f"the service at {config.url} lists no models at /v1/models")
    if config.model is not None and config.model not in served:
        raise UserError(f"model {config.model!r} is not served at {config.url} (it serves {', '.join(served)})")
    return config.model or served[0], health.json()


def error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase


def prompt_mix(categories: list[str] | None, prompt_set: PromptSetName = "project") -> list[Prompt]:
    """Categories interleaved (chat, code, …, chat, code, …), so even a short cell sees every kind."""
    known = load_prompt_set(prompt_set).categories
    chosen = {name: known[name] for name in categories or known}
    rounds = itertools.zip_longest(*(c.prompts for c in chosen.values()))
    return [
        Prompt(name, p.id, [m.model_dump() for m in p.messages])
        for row in rounds
        for name, p in zip(chosen, row, strict=True)
        if p is not None
    ]


SHARED_DOCUMENT_CHARS = 3000  # ~650 tokens of the embedded model: a long system prompt or a shared document


def with_shared_document(prompts: list[Prompt]) -> list[Prompt]:
    """Every prompt after one system message holding the same document (the prompt set's texts,
    joined): the shared-prefix workload — a long system prompt, few-shot examples or a RAG corpus
    that every request repeats."""
    texts = [m["content"] for p in prompts for m in p.messages if isinstance(m.get("content"), str)]
    document = "\n\n".join(texts)[:SHARED_DOCUMENT_CHARS]
    system = {"role": "system", "content": f"Answer using this document where it helps.\n\n{document}"}
    return [Prompt(p.category, p.id, [system, *(m for m in p.messages if m.get("role") != "system")]) for p in prompts]


class Conversation:
    """A multi-turn client's history: each turn is its next prompt's user message after every
    earlier turn and answer, until `MULTI_TURN_TURNS` turns, when a new conversation starts."""

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []
        self.turns = 0

    def next(self, prompt: Prompt) -> Prompt:
        if self.turns == MULTI_TURN_TURNS:
            self.history, self.turns = [], 0
        user = [m for m in prompt.messages if m.get("role") != "system"]
        return Prompt(prompt.category, f"{prompt.id}#turn{self.turns + 1}", [*self.history, *user])

    def answered(self, sent: Prompt, record: RequestRecord) -> None:
        self.history = [*sent.messages, {"role": "assistant", "content": record.text}]
        self.turns += 1


def _schedule(config: LoadConfig) -> list[Cell]:
    """Levels in order; within a level every mode under every batching, the order rotating from
    level to level, so no cell always runs first (cold caches) or last (a warm, throttled machine)."""
    pairs = [(m, b) for b in config.batching for m in config.modes]
    run = secrets.token_hex(4)  # a later run against the same service starts cold too
    levels = enumerate(config.levels())
    cells = [Cell(level, *pairs[(i + j) % len(pairs)]) for i, level in levels for j in range(len(pairs))]
    return [replace(c, cache_salt=f"bench-load-{run}-{n}") for n, c in enumerate(cells)]


async def _run_closed_cell(
    client: httpx.AsyncClient, config: LoadConfig, model: str, prompts: list[Prompt], cell: Cell, bar: tqdm
) -> tuple[list[RequestRecord], float]:
    """`concurrency` workers in a closed loop until the cell's requests are sent. Every cell starts
    at the same prompt, so the modes of one level serve the same requests."""
    tickets = iter(range(config.requests_at(cell.level)))  # shared: a worker takes the next when its last ends
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def worker() -> None:
        conversation = Conversation() if config.workload == "multi-turn" else None
        for index in tickets:
            prompt = prompts[index % len(prompts)]
            if conversation is not None:
                prompt = conversation.next(prompt)
            record = await timed_request(client, config, model, prompt, cell, start)
            if conversation is not None:
                conversation.answered(prompt, record)
            records.append(record)
            bar.update()

    await asyncio.gather(*(worker() for _ in range(cell.level.concurrency or 1)))
    return records, time.perf_counter() - start


async def _run_open_cell(
    client: httpx.AsyncClient, config: LoadConfig, model: str, prompts: list[Prompt], cell: Cell, bar: tqdm
) -> tuple[list[RequestRecord], float]:
    """Requests sent at Poisson arrival times (the same seeded times for every cell of a level),
    each on its own, however many are still in flight."""
    rate = cell.level.request_rate
    assert rate is not None
    gaps = np.random.default_rng(config.seed).exponential(1.0 / rate, config.requests_at(cell.level))
    start = time.perf_counter()

    async def one(index: int, at: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        record = await timed_request(client, config, model, prompts[index % len(prompts)], cell, start)
        bar.update()
        return record

    records = await asyncio.gather(*(one(i, float(at)) for i, at in enumerate(np.cumsum(gaps))))
    return list(records), time.perf_counter() - start


@dataclass
class Trace:
    """What one streamed response told us, with the time each part arrived."""

    started: float
    first_token: float | None = None
    ended: float | None = None
    content_chunks: int = 0
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    route: dict[str, Any] | None = None
    error: str | None = None
    first: asyncio.Event | None = None  # set when the first content token arrives

    def chunk(self, payload: Any) -> None:
        if not isinstance(payload, dict):
            raise StreamError(f"unexpected event {payload!r:.200}")
        if "error" in payload:  # a failure after the 200 was sent comes in-band
            error = payload["error"]
            raise StreamError(f"error event: {error.get('message') if isinstance(error, dict) else error}")
        for choice in payload.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.first_token = self.first_token or time.perf_counter()
                self.content_chunks += 1
                self.text += content
                if self.first is not None:
                    self.first.set()
        if payload.get("usage"):
            usage = payload["usage"]
            self.completion_tokens = int(usage["completion_tokens"])
            self.prompt_tokens = int(usage["prompt_tokens"]) if "prompt_tokens" in usage else None
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details["cached_tokens"]) if "cached_tokens" in details else None
        if payload.get("specroute"):
            self.route = payload["specroute"]

    def record(self, prompt: Prompt, cell: Cell, cell_start: float) -> RequestRecord:
        end = self.ended or time.perf_counter()
        # Without a usage chunk, content chunks are the best count of tokens there is.
        tokens = self.completion_tokens if self.completion_tokens is not None else self.content_chunks
        ok = self.error is None
        ttft = (self.first_token - self.started) * 1e3 if ok and self.first_token else None
        tpot = (end - self.first_token) * 1e3 / (tokens - 1) if ttft is not None and tokens > 1 else None
        return RequestRecord(
            mode=cell.mode,
            batching=cell.batching,
            level=cell.level,
            category=prompt.category,
            prompt_id=prompt.id,
            start_s=self.started - cell_start,
            ttft_ms=ttft,
            tpot_ms=tpot,
            e2e_ms=(end - self.started) * 1e3,
            completion_tokens=tokens if ok else 0,
            text=self.text if ok else "",
            backend=(self.route or {}).get("backend"),
            route=self.route,
            error=self.error,
            prompt_tokens=self.prompt_tokens if ok else None,
            cached_tokens=self.cached_tokens if ok else None,
        )


async def timed_request(
    client: httpx.AsyncClient,
    config: LoadConfig,
    model: str,
    prompt: Prompt,
    cell: Cell,
    cell_start: float,
    max_tokens: int | None = None,
    first: asyncio.Event | None = None,
) -> RequestRecord:
    """One streamed request, timed; any failure becomes the record's error, never the run's."""
    body = {
        "model": model,
        "messages": prompt.messages,
        "max_tokens": max_tokens or config.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "specroute": {"backend": cell.mode, "category": prompt.category, "batching": cell.batching},
    }
    if cell.cache_salt is not None:
        body["cache_salt"] = cell.cache_salt
    trace = Trace(started=time.perf_counter(), first=first)
    try:
        # httpx's timeout bounds each read; this bounds the whole request, however slowly it streams.
        async with asyncio.timeout(config.timeout_s):
            await _stream(client, config, body, trace)
    except TimeoutError:
        trace.error = f"timeout after {config.timeout_s:g} s"
    except (httpx.HTTPError, StreamError, ValueError) as exc:  # ValueError: a malformed JSON event
        trace.error = str(exc) if isinstance(exc, StreamError) else f"{type(exc).__name__}: {exc}"
    if first is not None:
        first.set()  # nobody waits forever on a request that failed
    return trace.record(prompt, cell, cell_start)


async def _stream(client: httpx.AsyncClient, config: LoadConfig, body: dict[str, Any], trace: Trace) -> None:
    url = _url(config, "/v1/chat/completions")
    async with client.stream("POST", url, json=body, headers=_headers(config)) as response:
        if response.status_code >= 400:
            await response.aread()
            raise StreamError(f"HTTP {response.status_code}: {error_message(response)}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments and keep-alives
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                trace.ended = time.perf_counter()
                return
            trace.chunk(json.loads(data))
    raise StreamError("stream ended before `data: [DONE]`")


async def probe_joins(client: httpx.AsyncClient, config: LoadConfig, model: str) -> list[JoinProbe]:
    """For every forced backend and batching: the join probe."""
    prompts = prompt_mix(None)
    short = next(p for p in prompts if p.category == "qa")
    long = next(p for p in prompts if p.category == "summarization")
    cells = [Cell(Level(concurrency=1), m, b) for b in config.batching for m in config.modes if m != ROUTER]
    return [await _probe_join(client, config, model, cell, short, long) for cell in cells]


async def _probe_join(
    client: httpx.AsyncClient, config: LoadConfig, model: str, cell: Cell, short: Prompt, long: Prompt
) -> JoinProbe:
    start = time.perf_counter()
    alone = [await timed_request(client, config, model, short, cell, start) for _ in range(2)]  # 1st warms up
    first = asyncio.Event()
    busy = asyncio.create_task(timed_request(client, config, model, long, cell, start, JOIN_LONG_TOKENS, first))
    await first.wait()
    joined = await timed_request(client, config, model, short, cell, start)
    background = await busy
    failed = next((r.error for r in (*alone, joined, background) if r.error), None)
    idle, during = alone[-1].ttft_ms, joined.ttft_ms
    return JoinProbe(
        mode=cell.mode,
        batching=cell.batching,
        idle_ttft_ms=idle,
        joined_ttft_ms=during,
        ttft_ratio=during / idle if idle and during is not None else None,
        same_text=failed is None and joined.text == alone[-1].text,
        long_tokens=background.completion_tokens,
        error=failed,
    )
