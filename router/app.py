"""The HTTP face: OpenAI-compatible routes over a `RouterCore`, with OpenAI-style JSON errors.

Bodies are read and validated here rather than by FastAPI's automatic parsing, so every bad
request — oversized, slow, not JSON, nested too deep, duplicate keys, numbers or strings Python
would choke on, wrong fields, out-of-range values, over a limit — gets a 4xx with
`{"error": {"message", "type", "param", "code"}}` saying what to fix, `param` naming the field.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from backends.errors import Overloaded, RequestError
from backends.generation import GenerationRequest, GenerationResult
from backends.streaming import StreamEvent

from .advise import backend_summaries, to_advice
from .core import Limits, Prepared, Routed, RouterCore
from .report import latest_dir
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    PromptTokensDetails,
    SpecrouteOptions,
    Usage,
    new_id,
    now,
)
from .strict_json import MAX_INT_DIGITS, BodyRefused, clip, dotted, parse_object

log = logging.getLogger("specroute.app")
Body = TypeVar("Body", bound=BaseModel)
MODEL_ALIASES = ("embedded", "default")
# uvicorn with httptools (what Serve's proxy runs) accepts headers of any size and number.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 * 1024
CLOSE = {"Connection": "close"}  # for a refusal sent before the body was read: the rest of it is not wanted


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def refused(cls, exc: RequestError) -> ApiError:
        """A backend's refusal: 429 with Retry-After when it is full, else 400."""
        if isinstance(exc, Overloaded):
            headers = {"Retry-After": str(exc.retry_after_s)}
            return cls(429, str(exc), code="rate_limit_exceeded", kind="rate_limit_error", headers=headers)
        return cls(400, str(exc))

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorBody(message=str(self), type=self.kind, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


class HeaderLimits:
    """431 for a request with more than MAX_HEADERS headers or MAX_HEADER_BYTES of them, before any
    route runs: the HTTP server in front passes any amount on, and a client should hear why."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        problem = _header_problem(scope["headers"]) if scope["type"] == "http" else None
        if problem is None:
            return await self.app(scope, receive, send)
        error = ApiError(431, problem, code="request_header_fields_too_large", headers=CLOSE)
        await error.response()(scope, receive, send)


def _header_problem(headers: list[tuple[bytes, bytes]]) -> str | None:
    size = sum(len(name) + len(value) for name, value in headers)
    if len(headers) > MAX_HEADERS:
        return f"{len(headers)} request headers exceed the limit of {MAX_HEADERS}: send fewer"
    if size > MAX_HEADER_BYTES:
        return f"request headers of {size} bytes exceed the limit of {MAX_HEADER_BYTES} bytes: send smaller ones"
    return None


class AdviseRequest(BaseModel):
    """`POST /v1/advise`: a prompt or messages, and optionally the concurrency to plan for."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = Field(None, min_length=1)
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    max_tokens: int = Field(256, ge=1)
    concurrency: int | None = Field(None, ge=1, le=100_000, description="default: the live load + this request")
    specroute: SpecrouteOptions = Field(default_factory=SpecrouteOptions)


def create_app(model_id: str, api_key: str | None = None) -> FastAPI:
    """The app; `install` (or `app.state.core = …`) gives it a `RouterCore` before it serves."""
    app = FastAPI(title="specroute", version="0.1.0", docs_url=None, redoc_url=None)
    app.add_middleware(HeaderLimits)
    if model_id:  # empty: `install` provides it (the Serve ingress)
        app.state.model_id, app.state.api_key = model_id, api_key

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        response = ApiError(exc.status_code, str(exc.detail), code=code).response()
        response.headers.update(exc.headers or {})  # a 405 keeps its Allow header
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return ApiError(500, f"internal error ({type(exc).__name__}); the request was not completed").response()

    @app.get("/healthz")
    async def healthz(request: Request) -> JSONResponse:
        """200 only when every backend has a live replica and the last policy applied; else 503 with why."""
        health = {**await _core(request).health(), "model": _setting(request, "model_id")}
        return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)

    @app.get("/metrics", response_model=None)
    async def metrics(request: Request) -> Response:
        """Prometheus text exposition: the router's counters and histograms and each backend's step loop."""
        body, content_type = await _core(request).metrics_exposition()
        return Response(body, media_type=content_type, headers={"Cache-Control": "no-store"})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(request)
        entry = {"id": _setting(request, "model_id"), "object": "model", "created": 0, "owned_by": "specroute"}
        # specroute's own field: what each backend holds in memory and the quantized one's measured quality.
        # And the dtype the target serves in, why, and what each profiled dtype was predicted to do; and
        # whether the profile is a quick probe's (provisional) and what it covers.
        core = _core(request)
        entry["specroute"] = {
            "backends": [b.model_dump() for b in backend_summaries(core.profile)],
            "dtype": core.dtype_choice.model_dump(mode="json"),
            "profile": {
                "measured": core.profile.created.isoformat(),
                "provisional": core.profile.provisional,
                "coverage": core.profile.coverage(),
                "note": core.provisional_note(),
            },
        }
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        body = await _parse(request, ChatCompletionRequest)
        return await _complete(request, body, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await _parse(request, CompletionRequest)
        return await _complete(request, body, chat=False)

    @app.post("/v1/advise")
    async def advise(request: Request) -> dict[str, Any]:
        body = await _parse(request, AdviseRequest)
        return _advise(request, body)

    @app.get("/report", response_model=None)
    async def report(request: Request) -> Response:
        """The latest capacity-planning report (`specroute report` publishes it), read-only."""
        return _report_file(request, "report.html", HTMLResponse)

    @app.get("/report.json", response_model=None)
    async def report_json(request: Request) -> Response:
        return _report_file(
            request, "report.json", lambda text, **kw: Response(text, media_type="application/json", **kw)
        )

    return app


def _report_file(request: Request, name: str, respond: Any) -> Response:
    """A file of the latest report, read on every request so a new report shows without a restart."""
    _authorize(request)
    folder = _setting(request, "report_dir") or latest_dir()
    try:
        text = (Path(folder) / name).read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise ApiError(
            404,
            f"no capacity-planning report yet: run `specroute report --workload deploy/workload.yaml --out DIR` "
            f"where the service runs (it publishes the latest to {folder})",
            code="not_found",
        ) from None
    return respond(text, headers={"Cache-Control": "no-store"})


# What `install` put in place for this process. Ray Serve serves a copy of the FastAPI app in the
# replica (not the object the deployment class sees), so its state cannot be set on the app alone.
_INSTALLED: dict[str, Any] = {}


def install(app: FastAPI, core: RouterCore, model_id: str, api_key: str | None) -> None:
    """Make `core` serve `app` (and every copy of it in this process)."""
    for name, value in (("core", core), ("model_id", model_id), ("api_key", api_key)):
        setattr(app.state, name, value)
        _INSTALLED[name] = value


def _setting(request: Request, name: str) -> Any:
    state = request.app.state
    return getattr(state, name) if hasattr(state, name) else _INSTALLED.get(name)


def _core(request: Request) -> RouterCore:
    return _setting(request, "core")


def _authorize(request: Request) -> None:
    key = _setting(request, "api_key")
    if not key:
        return
    given = request.headers.get("authorization", "")
    if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), key.encode()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


async def _parse(request: Request, model: type[Body]) -> Body:
    _authorize(request)
    _check_content_type(request)
    data = _decode(await _read_body(request, _core(request).limits))
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _check_model(request, getattr(body, "model", None))
    return body


def _check_content_type(request: Request) -> None:
    """JSON only. A request without Content-Type is read as JSON: it is what such a client means,
    and the body must still parse. (`curl -d` sends a form type, and hears what to add.)"""
    given = request.headers.get("content-type")
    if given is not None and given.partition(";")[0].strip().lower() != "application/json":
        message = (
            f"Content-Type {clip(given)!r} is not supported: send the body as JSON with "
            "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')"
        )
        raise ApiError(415, message, code="unsupported_media_type", headers=CLOSE)


async def _read_body(request: Request, limits: Limits) -> bytes:
    """The body, at most `max_body_bytes` of it, within `body_timeout_s`: a client trickling it in
    (slow loris) gets a 408 instead of holding the request open."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdecimal() and (len(declared) > MAX_INT_DIGITS or int(declared) > limit):
        message = f"request body of {clip(declared)} bytes exceeds the limit of {limit} bytes: send a shorter one"
        raise ApiError(413, message, headers=CLOSE)
    raw = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    message = f"request body exceeds the limit of {limit} bytes: send a shorter one"
                    raise ApiError(413, message, headers=CLOSE)
    except TimeoutError:
        message = (
            f"the request body did not arrive within {limits.body_timeout_s:g} s ({len(raw)} bytes came): "
            "send the whole body at once"
        )
        raise ApiError(408, message, code="request_timeout", headers=CLOSE) from None
    except ClientDisconnect:  # nobody to answer; not worth an "unexpected error" traceback in the log
        raise ApiError(400, "the client closed the connection before sending the whole body") from None
    return bytes(raw)


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        return parse_object(raw)
    except BodyRefused as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def _validation_error(exc: ValidationError) -> ApiError:
    problems = []
    for e in exc.errors()[:5]:
        where = dotted(e["loc"]) or "body"
        message = "unknown field (not part of this API)" if e["type"] == "extra_forbidden" else e["msg"]
        problems.append(f"{where}: {message}")
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    return ApiError(400, "; ".join(problems), param=dotted(first) or None)


def _check_model(request: Request, model: str | None) -> None:
    served = _setting(request, "model_id")
    if model is not None and model not in (served, *MODEL_ALIASES):
        message = f"model {model!r} is not served here: use {served!r}"
        raise ApiError(404, message, param="model", code="model_not_found")


async def _complete(request: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool):
    core = _core(request)
    try:
        prepared = _admit(core, body)
        routed = core.route(prepared)
    except (RequestError, ValueError) as exc:
        raise ApiError(400, str(exc)) from None
    events = core.run(prepared, routed)
    first = await _first_event(events)  # refusals surface as a 4xx before any byte is streamed
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _sse(first, events, routed, _setting(request, "model_id"), chat, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    result = first.result
    try:
        async for event in events:
            result = event.result or result
    except RequestError as exc:
        raise ApiError.refused(exc) from None
    except Exception as exc:
        log.exception("request failed on every attempt")
        raise ApiError(503, f"no backend could finish the request ({type(exc).__name__}); retry later") from None
    if result is None:
        raise ApiError(500, "the backend ended without a result")
    return JSONResponse(_completion_body(result, routed, _setting(request, "model_id"), chat))


def _admit(core: RouterCore, body: ChatCompletionRequest | CompletionRequest) -> Prepared:
    limits = core.limits
    chat = isinstance(body, ChatCompletionRequest)
    max_tokens = body.limit(min(limits.default_max_tokens, limits.max_tokens))
    messages = len(body.messages) if chat else 1
    max_tokens_field = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
    _check_limits(limits, messages, max_tokens, max_tokens_field)
    return _prepare(core, body.generation(max_tokens), body.specroute, messages, "messages" if chat else "prompt")


def _check_limits(limits: Limits, messages: int, max_tokens: int, max_tokens_field: str) -> None:
    """The limits `RouterCore.prepare` also enforces that one field decides, checked here first so
    that the error names the field as the client sent it (`max_completion_tokens` or `max_tokens`)."""
    if messages > limits.max_messages:
        message = f"{messages} messages exceed this service's limit of {limits.max_messages}: send fewer"
        raise ApiError(400, message, param="messages")
    if max_tokens > limits.max_tokens:
        message = f"{max_tokens_field} {max_tokens} exceeds this service's limit of {limits.max_tokens}: lower it"
        raise ApiError(400, message, param=max_tokens_field)


def _prepare(
    core: RouterCore, generation: GenerationRequest, options: SpecrouteOptions, messages: int, prompt_field: str
) -> Prepared:
    """`core.prepare`, its refusal naming the field at fault: past `_check_limits` it refuses only
    an unknown drafter, an unknown category, or a prompt over `max_prompt_tokens`."""
    try:
        return core.prepare(generation, options, messages)
    except RequestError as exc:
        if options.drafter is not None and options.drafter not in core.drafters:
            field = "specroute.drafter"
        elif options.category is not None and options.category not in core.profile.categories:
            field = "specroute.category"
        else:
            field = prompt_field
        raise ApiError(400, str(exc), param=field) from None


async def _first_event(events: AsyncIterator[StreamEvent]) -> StreamEvent:
    try:
        return await anext(events)
    except RequestError as exc:
        raise ApiError.refused(exc) from None
    except StopAsyncIteration:
        raise ApiError(500, "the backend produced nothing") from None
    except Exception as exc:
        log.exception("request failed on every attempt")
        raise ApiError(503, f"no backend could serve the request ({type(exc).__name__}); retry later") from None


def _usage(result: GenerationResult) -> Usage:
    total = result.prompt_tokens + result.completion_tokens
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        total_tokens=total,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens),
    )


def _completion_body(result: GenerationResult, routed: Routed, model: str, chat: bool) -> dict[str, Any]:
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
        kind, prefix = "text_completion", "cmpl"
    return {
        "id": new_id(prefix),
        "object": kind,
        "created": now(),
        "model": model,
        "choices": [choice],
        "usage": _usage(result).model_dump(),
        "specroute": routed.info(result).model_dump(),
    }


async def _sse(
    first: StreamEvent,
    events: AsyncIterator[StreamEvent],
    routed: Routed,
    model: str,
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    ident, created = new_id("chatcmpl" if chat else "cmpl"), now()
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, **extra: Any) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        else:
            choices = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
        if extra.pop("no_choices", False):
            choices = []
        payload = {"id": ident, "object": kind, "created": created, "model": model, "choices": choices, **extra}
        return f"data: {json.dumps(payload)}\n\n"

    if chat:
        yield chunk(None, None).replace('"delta": {}', '"delta": {"role": "assistant", "content": ""}', 1)
    result: GenerationResult | None = None
    try:
        event: StreamEvent | None = first
        while event is not None:
            if event.text:
                yield chunk(event.text, None)
            result = event.result or result
            event = await anext(events, None)
    except Exception as exc:  # after every retry: tell the client in-band, the status is already sent
        log.exception("stream failed")
        error = ErrorBody(message=f"the request failed mid-stream ({type(exc).__name__})", type="server_error")
        yield f"data: {json.dumps({'error': error.model_dump()})}\n\n"
        yield "data: [DONE]\n\n"
        return
    info = routed.info(result).model_dump()
    finish = result.finish_reason if result else "stop"
    if include_usage and result is not None:
        yield chunk(None, finish)
        yield chunk(None, None, no_choices=True, usage=_usage(result).model_dump(), specroute=info)
    else:
        yield chunk(None, finish, specroute=info)
    yield "data: [DONE]\n\n"


def _advise(request: Request, body: AdviseRequest) -> dict[str, Any]:
    core = _core(request)
    messages = len(body.messages) if body.messages is not None else 1
    _check_limits(core.limits, messages, body.max_tokens, "max_tokens")
    try:
        generation = _advise_generation(body)
        if generation is None:
            raise RequestError("give 'prompt' or 'messages'")
        prompt_field = "messages" if body.messages is not None else "prompt"
        prepared = _prepare(core, generation, body.specroute, messages, prompt_field)
        live = sum(core.load.values())
        extra = (body.concurrency - 1 - live) if body.concurrency else 0
        decision, features = core.decide(prepared, extra_load=max(extra, 0))
    except (RequestError, ValueError) as exc:
        raise ApiError(400, str(exc)) from None
    return to_advice(decision, features, core.profile, core.policy, core.dtype_choice).model_dump(mode="json")


def _advise_generation(body: AdviseRequest):
    if body.messages is not None:
        chat = ChatCompletionRequest.model_validate(
            {"model": body.model or "default", "messages": body.messages, "max_tokens": body.max_tokens}
        )
        return chat.generation(body.max_tokens)
    if body.prompt is not None:
        return CompletionRequest(model="default", prompt=body.prompt, max_tokens=body.max_tokens).generation(
            body.max_tokens
        )
    return None
