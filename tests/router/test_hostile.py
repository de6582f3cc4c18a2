"""Hostile input replayed from `hostile_corpus.json` over real sockets: every case gets the status
the corpus expects (a 4xx as `{"error": {...}}` naming the field at fault), cases at a limit are
served and one past it are refused, and a client trickling its body in never stops a normal request
from being served meanwhile.

(a) in-process: `create_app` under uvicorn (as Serve's proxy runs it: httptools) on a free port, over
a fake backend pool, with small limits; (b), marked slow: the live Ray Serve service."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import uvicorn
from pydantic import BaseModel, ConfigDict, Field

from backends.generation import GenerationResult
from backends.plain import prompt_ids
from backends.streaming import StreamEvent
from policies.config import PolicyConfig
from router import app as app_module
from router import schemas, strict_json
from router.app import create_app
from router.core import Limits, RouterCore
from router.schemas import ChatCompletionRequest, CompletionRequest
from tests.policies.profiles import synthetic_profile
from tests.router.conftest import _settings

CORPUS = Path(__file__).with_name("hostile_corpus.json")
MODEL = "SmolLM2-135M-Instruct"
LOCAL_LIMITS = Limits(
    max_prompt_tokens=300, max_tokens=16, default_max_tokens=8, max_messages=8, max_body_bytes=32768, body_timeout_s=2
)
WORD = " alpha"  # one token each time it repeats: how `$prompt_tokens` sizes a prompt
BASES = {  # what a case's `chat` or `completion` is merged over, and where it is sent
    "chat": (
        "/v1/chat/completions",
        {"model": "{{model}}", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1},
    ),
    "completion": ("/v1/completions", {"model": "{{model}}", "prompt": "Say hi.", "max_tokens": 1}),
}
SERVED_WITHIN_S = 20  # a normal request sent while a slow client is mid-body is answered within this


# -- the corpus ---------------------------------------------------------------------------------


class Flood(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int | str
    bytes_each: int | str


class Send(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: str = "POST"
    path: str | None = None
    chat: dict[str, Any] | None = None
    completion: dict[str, Any] | None = None
    body: Any = None
    headers: dict[str, str | None] = Field(default_factory=dict)
    header_flood: Flood | None = None
    pad_to_bytes: int | str | None = None
    seconds_per_byte: float | None = None


class Expect(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: int | tuple[int, int]
    param: str | None = None
    message: str | None = None


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    why: str = ""
    send: Send
    expect: Expect

    @property
    def slow(self) -> bool:
        """A client that never finishes its body: a normal request must be served meanwhile."""
        return self.expect.status == 408


NORMAL = Send(chat={})


def load_corpus() -> list[Case]:
    return [Case.model_validate(case) for case in json.loads(CORPUS.read_text())["cases"]]


CASES = load_corpus()


def limit_values(limits: Limits, model: str) -> dict[str, Any]:
    """What `{{name}}` stands for on a server with these limits."""
    return {
        **limits.model_dump(),
        "max_json_depth": strict_json.MAX_JSON_DEPTH,
        "max_headers": app_module.MAX_HEADERS,
        "max_header_bytes": app_module.MAX_HEADER_BYTES,
        "max_stops": schemas.MAX_STOPS,
        "max_stop_chars": schemas.MAX_STOP_CHARS,
        "max_user_chars": schemas.MAX_USER_CHARS,
        "max_name_chars": schemas.MAX_NAME_CHARS,
        "max_category_chars": schemas.MAX_CATEGORY_CHARS,
        "model": model,
    }


TEMPLATE = re.compile(r"\{\{(\w+)([+-]\d+)?\}\}")


def fill(text: str, values: dict[str, Any]) -> Any:
    """`{{name}}` / `{{name+1}}` replaced; a string that is one template becomes its value."""

    def value(match: re.Match[str]) -> Any:
        base = values[match[1]]
        return base + int(match[2]) if match[2] else base

    def spelled(match: re.Match[str]) -> str:
        number = value(match)
        return f"{number:g}" if isinstance(number, float) else str(number)  # 30.0 s reads "30 s", as in errors

    whole = TEMPLATE.fullmatch(text)
    return value(whole) if whole else TEMPLATE.sub(spelled, text)


class Encoder:
    """A corpus body as the bytes to send; `prompt_words` sizes any `$prompt_tokens` text."""

    def __init__(self, values: dict[str, Any], prompt_words: int = 1):
        self.values, self.prompt_words = values, prompt_words
        self.sized: int | None = None  # the token count a `$prompt_tokens` asked for

    def encode(self, node: Any) -> str:
        if isinstance(node, str):
            return json.dumps(fill(node, self.values))
        if isinstance(node, list):
            return "[" + ", ".join(self.encode(item) for item in node) + "]"
        if not isinstance(node, dict):
            return json.dumps(node)
        if "$raw" in node:
            pieces = node["$raw"] if isinstance(node["$raw"], list) else [node["$raw"]]
            return "".join(self.piece(piece) for piece in pieces)
        if "$raw_hex" in node:  # bytes that are not UTF-8 ride in the str as surrogate escapes
            return bytes.fromhex(node["$raw_hex"]).decode("utf-8", "surrogateescape")
        if "$pairs" in node:
            return self.object(node["$pairs"])
        if "$repeat" in node:
            return self.encode([node["$repeat"]] * self.number(node["times"]))
        if "$chars" in node:
            return json.dumps("x" * self.number(node["$chars"]))
        if "$prompt_tokens" in node:
            self.sized = self.number(node["$prompt_tokens"])
            return json.dumps(WORD * self.prompt_words)
        return self.object(list(node.items()))

    def object(self, pairs: list[Any]) -> str:
        return "{" + ", ".join(f"{json.dumps(key)}: {self.encode(value)}" for key, value in pairs) + "}"

    def piece(self, piece: Any) -> str:
        if isinstance(piece, dict):
            return fill(piece["$repeat"], self.values) * self.number(piece["times"])
        return fill(piece, self.values)

    def number(self, value: int | str) -> int:
        return count(value, self.values)


def count(value: int | str, values: dict[str, Any]) -> int:
    return value if isinstance(value, int) else int(fill(value, values))


def prompt_tokens(tokenizer, body: bytes) -> int:
    """The prompt tokens `RouterCore.prepare` counts for this body."""
    data = json.loads(body)
    if "messages" in data:
        request = ChatCompletionRequest.model_validate({"model": "m", "messages": data["messages"]})
    else:
        request = CompletionRequest.model_validate({"model": "m", "prompt": data["prompt"]})
    return len(prompt_ids(tokenizer, request.generation(1)))


def encode_body(send: Send, values: dict[str, Any], tokenizer) -> bytes:
    """The body's bytes; a `$prompt_tokens` prompt is sized from a first count (one word is one
    token) so that the request's prompt is exactly that many tokens."""
    overlays = [(BASES[kind][1], getattr(send, kind)) for kind in BASES if getattr(send, kind) is not None]
    node = {**overlays[0][0], **overlays[0][1]} if overlays else send.body

    def encoded(words: int) -> tuple[bytes, int | None]:
        encoder = Encoder(values, words)
        return encoder.encode(node).encode("utf-8", "surrogateescape"), encoder.sized

    body, target = encoded(1)
    if target is not None:
        body, _ = encoded(target - prompt_tokens(tokenizer, body) + 1)
        assert prompt_tokens(tokenizer, body) == target, f"could not size a prompt to {target} tokens"
    return body


@dataclass
class Outgoing:
    method: str
    head: bytes
    body: bytes
    seconds_per_byte: float | None


def build(send: Send, values: dict[str, Any], tokenizer, host: str) -> Outgoing:
    body = encode_body(send, values, tokenizer)
    if send.pad_to_bytes is not None:
        size = count(send.pad_to_bytes, values)
        assert len(body) <= size, f"the body is {len(body)} bytes before padding to {size}"
        body += b" " * (size - len(body))
    path = send.path or next(
        (BASES[kind][0] for kind in BASES if getattr(send, kind) is not None), "/v1/chat/completions"
    )
    headers: dict[str, str | None] = {
        "Host": host,
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "Connection": "close",
    }
    headers.update({name: None if value is None else str(fill(value, values)) for name, value in send.headers.items()})
    lines = [f"{send.method} {path} HTTP/1.1"] + [f"{name}: {value}" for name, value in headers.items() if value]
    if send.header_flood is not None:
        each = "a" * count(send.header_flood.bytes_each, values)
        lines += [f"X-Flood-{i}: {each}" for i in range(count(send.header_flood.count, values))]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return Outgoing(send.method, head, body, send.seconds_per_byte)


# -- a raw HTTP/1.1 client: header floods, bodies that lie about their length, a byte at a time --


@dataclass
class Reply:
    status: int
    body: bytes
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body)


def exchange(
    address: tuple[str, int], outgoing: Outgoing, timeout_s: float, head_sent: threading.Event | None = None
) -> Reply:
    """Send on one thread while reading the reply on this one, so a server that answers before the
    body is all in (413, 408, 431) is heard."""
    started = time.monotonic()
    with socket.create_connection(address, timeout=timeout_s) as sock:
        answered = threading.Event()
        args = (sock, outgoing, answered, head_sent or threading.Event())
        sender = threading.Thread(target=_send, args=args, daemon=True)
        sender.start()
        response = http.client.HTTPResponse(sock, method=outgoing.method)
        try:
            response.begin()
            body = response.read()
        finally:
            answered.set()
        sender.join(timeout_s)
    return Reply(response.status, body, time.monotonic() - started)


def _send(sock: socket.socket, outgoing: Outgoing, answered: threading.Event, head_sent: threading.Event) -> None:
    try:
        sock.sendall(outgoing.head)
        head_sent.set()
        if outgoing.seconds_per_byte is None:
            sock.sendall(outgoing.body)
            return
        for byte in outgoing.body:
            sock.sendall(bytes([byte]))
            if answered.wait(outgoing.seconds_per_byte):
                return
    except OSError:  # the server answered and closed while we were still sending: expected
        return


# -- replaying ----------------------------------------------------------------------------------


@dataclass
class Target:
    address: tuple[str, int]
    values: dict[str, Any]
    tokenizer: Any
    pool: OnePool | None = None  # in-process: counts what reached a backend

    def send(self, send: Send, head_sent: threading.Event | None = None) -> Reply:
        host = f"{self.address[0]}:{self.address[1]}"
        outgoing = build(send, self.values, self.tokenizer, host)
        return exchange(self.address, outgoing, self.values["body_timeout_s"] + 60, head_sent)


def check(case: Case, reply: Reply, values: dict[str, Any]) -> None:
    expect = case.expect
    low, high = expect.status if isinstance(expect.status, tuple) else (expect.status, expect.status)
    assert low <= reply.status <= high, f"{case.name}: {reply.status} {reply.body[:300]!r}"
    try:
        body = reply.json()
    except ValueError:
        raise AssertionError(f"{case.name}: the reply is not JSON: {reply.body[:300]!r}") from None
    if reply.status < 400:
        assert isinstance(body, dict) and "error" not in body, f"{case.name}: {body}"
        return
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    if "param" in expect.model_fields_set:
        assert error["param"] == expect.param, f"{case.name}: param {error['param']!r} in {error}"
    if expect.message is not None:
        assert fill(expect.message, values) in error["message"], f"{case.name}: {error['message']!r}"


def replay(target: Target, case: Case) -> None:
    """One case; a slow one with a normal request sent, and served, while it is still open."""
    if not case.slow:
        check(case, target.send(case.send), target.values)
        return
    replies: list[Reply] = []
    head_sent = threading.Event()
    slow = threading.Thread(target=lambda: replies.append(target.send(case.send, head_sent)), daemon=True)
    slow.start()
    assert head_sent.wait(30), f"{case.name}: could not send the request head"
    normal = target.send(NORMAL)
    assert normal.status == 200 and normal.seconds < SERVED_WITHIN_S, (normal.status, normal.body[:300])
    assert slow.is_alive(), f"{case.name}: the slow client was answered before the normal request"
    slow.join(target.values["body_timeout_s"] + 60)
    [reply] = replies
    check(case, reply, target.values)
    assert reply.seconds < target.values["body_timeout_s"] + 10, f"{case.name}: answered after {reply.seconds:.1f} s"


class OnePool:
    """A `BackendPool` answering "Hi" to everything; `calls` counts what reached it."""

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, backend: str, request: dict[str, Any], drafter: str | None, batching: str = "continuous"):
        self.calls += 1
        result = GenerationResult(
            text="Hi", token_ids=[1], finish_reason="stop", prompt_tokens=3, completion_tokens=1,
            ttft_s=0.01, tpot_s=0.0, seed=1,
        )  # fmt: skip
        yield StreamEvent(text="Hi", token_ids=[1], result=result)


@pytest.fixture(scope="module")
def local(tokenizer) -> Iterator[Target]:
    """The app under uvicorn on a free port, on a thread, with uvicorn's defaults as Serve's proxy
    uses them (httptools parses HTTP when it is installed)."""
    pool = OnePool()
    app = create_app(MODEL)
    app.state.core = RouterCore(synthetic_profile(), PolicyConfig(), tokenizer, pool, LOCAL_LIMITS)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield Target(sock.getsockname(), limit_values(LOCAL_LIMITS, MODEL), tokenizer, pool)
    server.should_exit = True
    thread.join(10)


def test_every_case_at_a_limit_has_its_one_past_twin():
    names = {case.name for case in CASES}
    at = [name for name in names if "-at-" in name]
    assert len(at) >= 12
    assert not [name for name in at if name.replace("-at-", "-one-past-") not in names]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_input_gets_the_expected_answer_in_process(local, case):
    before = local.pool.calls
    replay(local, case)
    # Only a served case reaches a backend, and the normal request sent beside a slow one.
    assert local.pool.calls - before == (case.expect.status == 200) + case.slow


def test_the_server_still_serves_after_the_corpus(local):
    reply = local.send(NORMAL)
    assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == "Hi"


@pytest.mark.slow
def test_hostile_input_gets_the_expected_answer_from_the_live_service(service, tokenizer):
    host, port = service.url.removeprefix("http://").rsplit(":", 1)
    model = httpx.get(f"{service.url}/v1/models", timeout=60).json()["data"][0]["id"]
    limits = Limits.model_validate(_settings(service.profile)["limits"])
    target = Target((host, int(port)), limit_values(limits, model), tokenizer)
    failures = []
    for case in CASES:
        try:
            replay(target, case)
        except (AssertionError, OSError, http.client.HTTPException) as exc:
            failures.append(f"{case.name}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)
    assert target.send(NORMAL).status == 200
