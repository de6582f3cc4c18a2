"""The HTTP face: OpenAI-compatible routes over a `RouterCore`, with OpenAI-style JSON errors.

Bodies are read and validated here rather than by FastAPI's automatic parsing, so every bad
request — oversized, not JSON, wrong fields, out-of-range values, over a limit — gets a 4xx with
`{"error": {"message", "type", "param", "code"}}` saying what to fix.
"""

from __future__ import annotations

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

from backends.errors import Overloaded, RequestError
from backends.generation import GenerationResult
from backends.streaming import StreamEvent

from .advise import backend_summaries, to_advice
from .core import Routed, RouterCore
from .report import latest_dir
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    SpecrouteOptions,
    Usage,
    new_id,
    now,
)

log = logging.getLogger("specroute.app")
Body = TypeVar("Body", bound=BaseModel)
MODEL_ALIASES = ("embedded", "default")


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
    async def healthz(request: Request) -> dict[str, Any]:
        return {**_core(request).health(), "model": _setting(request, "model_id")}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(request)
        entry = {"id": _setting(request, "model_id"), "object": "model", "created": 0, "owned_by": "specroute"}
        # specroute's own field: what each backend holds in memory and the quantized one's measured quality.
        # And the dtype the target serves in, why, and what each profiled dtype was predicted to do.
        core = _core(request)
        entry["specroute"] = {
            "backends": [b.model_dump() for b in backend_summaries(core.profile)],
            "dtype": core.dtype_choice.model_dump(mode="json"),
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
    limit = _core(request).limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _check_model(request, getattr(body, "model", None))
    return body


def _validation_error(exc: ValidationError) -> ApiError:
    problems = []
    for e in exc.errors()[:5]:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        message = "unknown field (not part of this API)" if e["type"] == "extra_forbidden" else e["msg"]
        problems.append(f"{where}: {message}")
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    return ApiError(400, "; ".join(problems), param=".".join(str(p) for p in first) or None)


def _check_model(request: Request, model: str | None) -> None:
    served = _setting(request, "model_id")
    if model is not None and model not in (served, *MODEL_ALIASES):
        message = f"model {model!r} is not served here: use {served!r}"
        raise ApiError(404, message, param="model", code="model_not_found")


async def _complete(request: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool):
    core = _core(request)
    limits = core.limits
    messages = len(body.messages) if isinstance(body, ChatCompletionRequest) else 1
    try:
        generation = body.generation(body.limit(min(limits.default_max_tokens, limits.max_tokens)))
        prepared = core.prepare(generation, body.specroute, messages)
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
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens, total_tokens=total)


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
    try:
        generation = _advise_generation(body)
        if generation is None:
            raise RequestError("give 'prompt' or 'messages'")
        prepared = core.prepare(generation, body.specroute)
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
