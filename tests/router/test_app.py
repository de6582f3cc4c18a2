"""The HTTP app in-process (`TestClient`) over a `RouterCore` with a fake backend pool: malformed
requests get OpenAI-style 4xx errors, good ones get OpenAI shapes plus `specroute`, the official
`openai` client works against it, routing follows load, retries keep served tokens, policy reloads
keep the last good policy, and the API key guards the /v1 routes.

No model weights: only the embedded model's tokenizer (local cache) to count prompt tokens."""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from backends.generation import GenerationResult
from backends.models import load_tokenizer
from backends.speculative.stats import SpeculationStats
from backends.streaming import StreamEvent
from policies.config import PolicyConfig
from policies.serving_dtype import choose_dtype
from router.app import create_app
from router.core import Limits, RouterCore
from router.schemas import ChatCompletionRequest
from tests.policies.profiles import in_dtype, synthetic_profile

MODEL = "SmolLM2-135M-Instruct"
WORDS = [" alpha", " beta", " gamma", " delta", " epsilon", " theta"]  # one token each
STOP = ["###"]  # most requests carry a stop list; dedicated tests cover requests without one
LIMITS = dict(
    max_prompt_tokens=200, max_tokens=64, default_max_tokens=32, max_messages=4, max_body_bytes=8192, retries=1
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


CACHED = 4  # prompt tokens every fake answer found in the prefix cache


class FakePool:
    """A `BackendPool` streaming WORDS one token per event, then a final event with the result.

    A resumed request (`resume_ids`) continues after the words already sent. `fail_after[backend]
    = n` raises RuntimeError after n events on that backend; `error_after[backend] = (n, message)`
    yields `StreamEvent(error=message)` after n events; `full[backend] = s` answers that the backend
    is full (retry after s seconds). Every call is recorded, with its batching."""

    def __init__(self, tokenizer) -> None:
        self.ids = [tokenizer.encode(w, add_special_tokens=False) for w in WORDS]
        assert all(len(i) == 1 for i in self.ids)
        self.calls: list[tuple[str, dict[str, Any], str | None]] = []
        self.fail_after: dict[str, int] = {}
        self.error_after: dict[str, tuple[int, str]] = {}
        self.full: dict[str, int] = {}
        self.batching: list[str] = []

    def backends(self) -> list[str]:
        return [backend for backend, _, _ in self.calls]

    async def stream(self, backend: str, request: dict[str, Any], drafter: str | None, batching: str = "continuous"):
        self.calls.append((backend, request, drafter))
        self.batching.append(batching)
        if backend in self.full:
            yield StreamEvent(error=f"the {backend} backend is full: retry later", retry_after_s=self.full[backend])
            return
        start = len(request["resume_ids"])
        chosen = list(range(start, min(start + request["max_tokens"], len(WORDS))))
        text, ids = "", []
        for n, i in enumerate(chosen):
            if self.fail_after.get(backend) == n:
                raise RuntimeError(f"{backend} replica died")
            if backend in self.error_after and self.error_after[backend][0] == n:
                yield StreamEvent(error=self.error_after[backend][1])
                return
            text, ids = text + WORDS[i], ids + self.ids[i]
            yield StreamEvent(text=WORDS[i], token_ids=self.ids[i])
        stats = None
        if backend == "speculative":
            stats = SpeculationStats(
                drafter=drafter or "ngram", k_mode="auto", steps=3, drafts=3, draft_tokens=6,
                accepted_tokens=3, judged_tokens=4, requested_steps=3,
            )  # fmt: skip
        result = GenerationResult(
            text=text,
            token_ids=ids,
            finish_reason="length",
            prompt_tokens=11,
            completion_tokens=len(ids),
            ttft_s=0.05,
            tpot_s=0.01,
            seed=request["sampling"].get("seed") or 7,
            speculation=stats,
            cached_tokens=CACHED,
        )
        yield StreamEvent(result=result)


def make_core(tokenizer, **limits: Any) -> RouterCore:
    pool = FakePool(tokenizer)
    profile = synthetic_profile(quantized_agreement=0.99)
    return RouterCore(profile, PolicyConfig(), tokenizer, pool, Limits(**{**LIMITS, **limits}))


def make_app(tokenizer, api_key: str | None = None, **limits: Any):
    app = create_app(MODEL, api_key=api_key)
    app.state.core = make_core(tokenizer, **limits)
    return app


@pytest.fixture
def app(tokenizer):
    return make_app(tokenizer)


@pytest.fixture
def client(app):
    return TestClient(app)


@pytest.fixture
def core(app) -> RouterCore:
    return app.state.core


@pytest.fixture
def pool(core) -> FakePool:
    return core.pool


def chat_body(content: str = "copy prompt 1", category: str | None = "copy", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    body["stop"] = STOP
    if category:
        body["specroute"] = {"category": category}
    return {**body, **extra}


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "copy prompt 2", "max_tokens": 8, "stop": STOP, **extra}


def assert_openai_error(response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


def sse(response) -> list[Any]:
    """The `data:` payloads of an SSE response, JSON-decoded except the final "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- 1. bad input ------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ADVISE = "/v1/advise"
LONG = " word" * 400  # 400 tokens > max_prompt_tokens 200, still under max_body_bytes
BIG = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 9000}]}  # > max_body_bytes 8192


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def with_specroute(**options: Any) -> dict[str, Any]:
    return chat_body(category=None, specroute=options)


def raw(text: str) -> bytes:
    return text.encode()


# (method, path, body: dict/list → JSON, bytes → raw, None → no body), status, text the message must contain
BAD_INPUTS = {
    "chat-not-json": ("POST", CHAT, b"{not json", 400, "not valid JSON"),
    "chat-invalid-utf8": ("POST", CHAT, b'{"model": "\xff\xfe"}', 400, "JSON"),
    "chat-json-array": ("POST", CHAT, [chat_body()], 400, "JSON object"),
    "chat-json-string": ("POST", CHAT, raw('"hello"'), 400, "JSON object"),
    "chat-empty-body": ("POST", CHAT, b"", 400, "JSON"),
    "chat-missing-model": ("POST", CHAT, without(chat_body(), "model"), 400, "model"),
    "chat-null-model": ("POST", CHAT, chat_body(model=None), 400, "model"),
    "chat-missing-messages": ("POST", CHAT, without(chat_body(), "messages"), 400, "messages"),
    "chat-empty-messages": ("POST", CHAT, chat_body(messages=[]), 400, "messages"),
    "chat-bad-role": ("POST", CHAT, chat_body(messages=[{"role": "tool", "content": "hi"}]), 400, "role"),
    "chat-content-number": ("POST", CHAT, chat_body(messages=[{"role": "user", "content": 42}]), 400, "content"),
    "chat-message-not-object": ("POST", CHAT, chat_body(messages=["hi"]), 400, "messages"),
    "chat-image-part": (
        "POST",
        CHAT,
        chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "text content parts",
    ),
    "chat-temperature-negative": ("POST", CHAT, chat_body(temperature=-1), 400, "temperature"),
    "chat-temperature-3": ("POST", CHAT, chat_body(temperature=3), 400, "temperature"),
    "chat-temperature-string": ("POST", CHAT, chat_body(temperature="hot"), 400, "temperature"),
    "chat-temperature-nan": ("POST", CHAT, raw(json.dumps(chat_body(temperature=math.nan))), 400, "temperature"),
    "chat-temperature-inf": ("POST", CHAT, raw(json.dumps(chat_body(temperature=math.inf))), 400, "temperature"),
    "chat-top-p-0": ("POST", CHAT, chat_body(top_p=0), 400, "top_p"),
    "chat-top-p-1.5": ("POST", CHAT, chat_body(top_p=1.5), 400, "top_p"),
    "chat-top-k-negative": ("POST", CHAT, chat_body(top_k=-1), 400, "top_k"),
    "chat-n-2": ("POST", CHAT, chat_body(n=2), 400, "n"),
    "chat-max-tokens-0": ("POST", CHAT, chat_body(max_tokens=0), 400, "max_tokens"),
    "chat-max-tokens-negative": ("POST", CHAT, chat_body(max_tokens=-5), 400, "max_tokens"),
    "chat-max-tokens-over-limit": ("POST", CHAT, chat_body(max_tokens=65), 400, "limit of 64"),
    "chat-max-completion-tokens-over-limit": (
        "POST",
        CHAT,
        chat_body(max_completion_tokens=1000),
        400,
        "limit of 64",
    ),
    "chat-prompt-too-long": ("POST", CHAT, chat_body(content=LONG), 400, "limit of 200"),
    "chat-too-many-messages": (
        "POST",
        CHAT,
        chat_body(messages=[{"role": "user", "content": "hi"}] * 5),
        400,
        "limit of 4",
    ),
    "chat-five-stops": ("POST", CHAT, chat_body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    "chat-empty-stop": ("POST", CHAT, chat_body(stop=""), 400, "stop"),
    "chat-stream-options-without-stream": (
        "POST",
        CHAT,
        chat_body(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    "chat-logprobs": ("POST", CHAT, chat_body(logprobs=True), 400, "logprobs"),
    "chat-presence-penalty": ("POST", CHAT, chat_body(presence_penalty=0.5), 400, "presence_penalty"),
    "chat-frequency-penalty": ("POST", CHAT, chat_body(frequency_penalty=-1), 400, "frequency_penalty"),
    "chat-seed-negative": ("POST", CHAT, chat_body(seed=-1), 400, "seed"),
    "chat-tools": ("POST", CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    "chat-unknown-field": ("POST", CHAT, chat_body(frobnicate=True), 400, "frobnicate"),
    "chat-unknown-specroute-field": ("POST", CHAT, with_specroute(turbo=True), 400, "specroute.turbo"),
    "chat-specroute-not-object": ("POST", CHAT, chat_body(specroute="fast"), 400, "specroute"),
    "chat-specroute-backend-gpu": ("POST", CHAT, with_specroute(backend="gpu"), 400, "backend"),
    "chat-unknown-category": ("POST", CHAT, with_specroute(category="poetry"), 400, "category 'poetry'"),
    "chat-unknown-model": ("POST", CHAT, chat_body(model="gpt-4o"), 404, "gpt-4o"),
    "completion-two-prompts": ("POST", COMPLETIONS, completion_body(prompt=["a", "b"]), 400, "exactly one prompt"),
    "completion-empty-prompt": ("POST", COMPLETIONS, completion_body(prompt=""), 400, "prompt is empty"),
    "completion-missing-prompt": ("POST", COMPLETIONS, without(completion_body(), "prompt"), 400, "prompt"),
    "completion-prompt-number": ("POST", COMPLETIONS, completion_body(prompt=5), 400, "prompt"),
    "completion-echo": ("POST", COMPLETIONS, completion_body(echo=True), 400, "echo"),
    "completion-suffix": ("POST", COMPLETIONS, completion_body(suffix="!"), 400, "suffix"),
    "completion-seed-negative": ("POST", COMPLETIONS, completion_body(seed=-1), 400, "seed"),
    "completion-max-tokens-over-limit": ("POST", COMPLETIONS, completion_body(max_tokens=500), 400, "limit of 64"),
    "completion-unknown-model": ("POST", COMPLETIONS, completion_body(model="davinci"), 404, "davinci"),
    "completion-not-json": ("POST", COMPLETIONS, b"prompt=hi", 400, "not valid JSON"),
    "advise-nothing-to-advise": ("POST", ADVISE, {"max_tokens": 8}, 400, "'prompt' or 'messages'"),
    "advise-concurrency-0": ("POST", ADVISE, {"prompt": "hi", "concurrency": 0}, 400, "concurrency"),
    "advise-unknown-field": ("POST", ADVISE, {"prompt": "hi", "stream": True}, 400, "stream"),
    "advise-empty-messages": ("POST", ADVISE, {"messages": []}, 400, "messages"),
    "advise-empty-prompt": ("POST", ADVISE, {"prompt": ""}, 400, "prompt"),
    "advise-unknown-model": ("POST", ADVISE, {"prompt": "hi", "model": "gpt-4o"}, 404, "gpt-4o"),
    "advise-json-array": ("POST", ADVISE, [], 400, "JSON object"),
    "body-over-limit": ("POST", CHAT, BIG, 413, "8192 bytes"),
    "completion-body-over-limit": ("POST", COMPLETIONS, raw(" " * 9000 + "{}"), 413, "8192 bytes"),
    "get-on-chat": ("GET", CHAT, None, 405, "Method Not Allowed"),
    "delete-on-completions": ("DELETE", COMPLETIONS, None, 405, "Method Not Allowed"),
    "post-on-models": ("POST", "/v1/models", {}, 405, "Method Not Allowed"),
    "unknown-route": ("POST", "/v1/embeddings", {"input": "hi"}, 404, "Not Found"),
    "unknown-get-route": ("GET", "/v2/models", None, 404, "Not Found"),
}


@pytest.fixture(scope="module")
def shared(tokenizer):
    """One app for the whole bad-input suite, so the test after it sees what the suite left behind."""
    return TestClient(make_app(tokenizer))


def send(client: TestClient, method: str, path: str, body: Any, **kwargs: Any):
    if body is None:
        return client.request(method, path, **kwargs)
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers={"content-type": "application/json"}, **kwargs)
    return client.request(method, path, json=body, **kwargs)


@pytest.mark.parametrize("case", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_input_gets_an_openai_style_4xx(shared, case):
    method, path, body, status, needle = case
    error = assert_openai_error(send(shared, method, path, body), status)
    assert needle in error["message"]
    assert error["type"] == "invalid_request_error"
    assert not shared.app.state.core.pool.calls  # nothing bad reached a backend


def test_the_suite_counts_enough_cases():
    assert len(BAD_INPUTS) >= 30


def test_bad_field_is_named_in_param(client):
    assert assert_openai_error(client.post(CHAT, json=chat_body(temperature=3)), 400)["param"] == "temperature"
    assert assert_openai_error(client.post(CHAT, json=chat_body(top_p=0)), 400)["param"] == "top_p"
    bad_role = chat_body(messages=[{"role": "tool", "content": "hi"}])
    assert assert_openai_error(client.post(CHAT, json=bad_role), 400)["param"] == "messages.0.role"
    error = assert_openai_error(client.post(CHAT, json=chat_body(model="gpt-4o")), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert assert_openai_error(client.get("/nope"), 404)["code"] == "not_found"


def test_chunked_body_over_the_limit_is_413(client, pool):
    def chunks():
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    response = client.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert "exceeds the limit of 8192 bytes" in assert_openai_error(response, 413)["message"]
    assert not pool.calls


def test_the_app_still_serves_after_the_bad_input_suite(shared):
    response = shared.post(CHAT, json=chat_body())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "".join(WORDS)
    assert shared.get("/healthz").json()["in_flight"] == {"speculative": 0, "plain": 0, "quantized": 0}


# -- 2. good paths -------------------------------------------------------------------------------


def test_chat_completion_has_the_openai_shape_and_specroute(client, pool):
    response = client.post(CHAT, json=chat_body())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["message"] == {"role": "assistant", "content": "".join(WORDS)}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 6,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }
    info = body["specroute"]
    assert info["backend"] == "speculative" and info["drafter"] == "ngram" and info["k"] >= 1
    assert info["stage"] == "speculation" and info["reasons"] and all(isinstance(r, str) for r in info["reasons"])
    assert info["concurrency"] == 1 and info["retried"] is False
    assert info["alpha"] == pytest.approx(0.75) and info["accepted_tokens"] == 3 and info["draft_tokens"] == 6
    assert info["ttft_ms"] == pytest.approx(50) and info["tpot_ms"] == pytest.approx(10)
    [(backend, request, drafter)] = pool.calls
    assert (backend, drafter) == ("speculative", "ngram")
    assert request["messages"] == [{"role": "user", "content": "copy prompt 1"}]
    assert request["max_tokens"] == 8 and request["stop"] == STOP and request["resume_ids"] == []


def test_chat_request_maps_sampling_parts_and_aliases(client, pool):
    body = chat_body(
        model="default",
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "copy "}, {"type": "text", "text": "this"}]},
        ],
        temperature=0,
        top_p=0.5,
        top_k=3,
        seed=42,
        max_tokens=None,
        max_completion_tokens=3,
        tools=[],
    )
    response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL
    assert response.json()["choices"][0]["message"]["content"] == "".join(WORDS[:3])
    request = pool.calls[0][1]
    assert request["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy this"}]
    assert request["max_tokens"] == 3
    assert {"temperature": 0.0, "top_p": 0.5, "top_k": 3, "seed": 42}.items() <= request["sampling"].items()


def test_chat_without_max_tokens_gets_the_default(client, pool):
    assert client.post(CHAT, json=without(chat_body(), "max_tokens")).status_code == 200
    assert pool.calls[0][1]["max_tokens"] == LIMITS["default_max_tokens"]


NO_STOP = [(CHAT, without(chat_body(), "stop")), (COMPLETIONS, without(completion_body(), "stop"))]


@pytest.mark.parametrize("path,body", NO_STOP, ids=["chat", "completion"])
def test_a_request_without_stop_is_served(client, path, body):
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text


def test_completion_has_the_openai_shape(client, pool):
    response = client.post(COMPLETIONS, json=completion_body(max_tokens=4, model="embedded"))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["text"] == "".join(WORDS[:4]) and choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert body["specroute"]["backend"] in ("speculative", "plain", "quantized") and body["specroute"]["reasons"]
    assert pool.calls[0][1]["prompt"] == "copy prompt 2" and pool.calls[0][1]["max_tokens"] == 4


def test_streaming_chat_over_raw_sse(client, core):
    with client.stream("POST", CHAT, json=chat_body(stream=True)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "".join(WORDS)
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["delta"] == {}
    assert final["specroute"]["backend"] == "speculative" and final["specroute"]["reasons"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "usage" not in final
    assert sum(core.load.values()) == 0


def test_streaming_chat_with_usage(client):
    body = chat_body(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", CHAT, json=body) as response:
        events = sse(response)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 6,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }
    assert usage["specroute"]["backend"] == "speculative"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "".join(WORDS)


def test_streaming_completion(client):
    body = completion_body(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", COMPLETIONS, json=body) as response:
        events = sse(response)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(WORDS)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


def test_models_and_healthz(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    backends = {b["backend"]: b for b in models["data"][0]["specroute"]["backends"]}
    assert set(backends) <= {"speculative", "plain", "quantized"} and backends["plain"]["weight_bytes"] > 0
    if "quantized" in backends:  # the method it serves, its memory and its measured quality
        assert backends["quantized"]["weights"] and backends["quantized"]["agreement"] is not None
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["policy_error"] is None
    assert health["policy"]["speculation"]["enabled"] is True
    # No choice handed in: the profile's dtype serves, and says so.
    assert models["data"][0]["specroute"]["dtype"]["dtype"] == health["dtype"] == "float32"
    assert health["dtype_reason"] == "float32: the profile's dtype"


def test_models_advise_and_each_reply_say_which_dtype_serves_and_why(tokenizer):
    fp32 = synthetic_profile(quantized_agreement=0.99)
    bf16 = in_dtype(fp32, "bfloat16", 0.5)
    choice = choose_dtype([fp32, bf16], PolicyConfig())
    app = create_app(MODEL)
    app.state.core = RouterCore(
        bf16, PolicyConfig(), tokenizer, FakePool(tokenizer), Limits(**LIMITS), None, None, choice
    )
    client = TestClient(app)
    shown = client.get("/v1/models").json()["data"][0]["specroute"]["dtype"]
    assert shown["dtype"] == "bfloat16" and shown["reason"] == choice.reason
    assert [o["dtype"] for o in shown["outlooks"]] == ["float32", "bfloat16"]
    advice = client.post(ADVISE, json={"prompt": "copy prompt 1", "max_tokens": 8}).json()
    assert advice["dtype"]["dtype"] == "bfloat16" and "tok/s for a lone request" in advice["dtype"]["reason"]
    reply = client.post(CHAT, json=chat_body(specroute={"backend": "plain"})).json()
    assert reply["specroute"]["weights"] == "bfloat16"
    reply = client.post(CHAT, json=chat_body(specroute={"backend": "quantized"})).json()
    assert reply["specroute"]["weights"] == "int4-weight-only"


def test_a_provisional_profile_shows_in_healthz_models_and_every_reply(tokenizer, tmp_path):
    """Until the full profile replaces it: /healthz stays ok and says so, /v1/models says what it
    covers, and every reply's reasons (forced ones too) start with it; then all of that goes."""
    probe = synthetic_profile(quantized_agreement=0.99).model_copy(update={"provisional": True})
    app = create_app(MODEL)
    app.state.core = core = RouterCore(probe, PolicyConfig(), tokenizer, FakePool(tokenizer), Limits(**LIMITS))
    client = TestClient(app)
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["profile_provisional"].startswith("provisional profile: target passes")
    assert "each backend's step loop times its own passes" in health["profile_provisional"]
    shown = client.get("/v1/models").json()["data"][0]["specroute"]["profile"]
    assert shown["provisional"] is True and shown["note"] == health["profile_provisional"]
    assert shown["coverage"] == probe.coverage()
    for options in ({"category": "copy"}, {"backend": "plain"}):
        reasons = client.post(CHAT, json=chat_body(specroute=options)).json()["specroute"]["reasons"]
        assert reasons[0] == probe.provisional_reason()
    advice = client.post(ADVISE, json={"prompt": "copy prompt 1", "max_tokens": 8}).json()
    assert advice["reasons"][0] == probe.provisional_reason()
    full = tmp_path / "full.json"
    synthetic_profile(quantized_agreement=0.99).save(full)
    assert core.apply_profile(full)
    assert client.get("/healthz").json()["profile_provisional"] is None
    assert client.get("/v1/models").json()["data"][0]["specroute"]["profile"]["provisional"] is False
    reasons = client.post(CHAT, json=chat_body()).json()["specroute"]["reasons"]
    assert not any("provisional" in r for r in reasons)


# -- 3. the official openai client -----------------------------------------------------------------


@pytest.fixture
def oai(app) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=TestClient(app), max_retries=0)


def test_openai_client_chat(oai, pool):
    messages = [{"role": "user", "content": "copy prompt 1"}]
    completion = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, stop=STOP, extra_body={"specroute": {"category": "copy"}}
    )
    assert completion.choices[0].message.content == "".join(WORDS[:5])
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    assert completion.model_extra["specroute"]["backend"] == "speculative"
    assert pool.backends() == ["speculative"]


def test_openai_client_streaming_chat(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stop=STOP,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(WORDS[:4])
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_client_completion_and_models(oai):
    completion = oai.completions.create(model=MODEL, prompt="copy prompt 2", max_tokens=2, stop=STOP)
    assert completion.object == "text_completion" and completion.choices[0].text == "".join(WORDS[:2])
    assert [m.id for m in oai.models.list()] == [MODEL]


def test_openai_client_forces_the_plain_backend(oai, pool):
    completion = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "copy prompt 1"}],
        max_tokens=2,
        stop=STOP,
        extra_body={"specroute": {"backend": "plain", "category": "copy"}},
    )
    assert pool.calls == [("plain", pool.calls[0][1], None)]
    assert completion.model_extra["specroute"]["stage"] == "forced"


def test_openai_client_gets_a_bad_request_error(oai, pool):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=3, stop=STOP)
    assert caught.value.status_code == 400 and "temperature" in caught.value.message
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' is not served here: use 'SmolLM2-135M-Instruct'"):
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stop=STOP)
    assert not pool.calls


def test_openai_client_chat_without_stop(oai):
    completion = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert completion.choices[0].message.content == "".join(WORDS[:2])


# -- 4. routing under load -------------------------------------------------------------------------


def test_a_lone_copy_request_speculates_and_load_moves_it_off(client, core, pool):
    alone = client.post(CHAT, json=chat_body()).json()["specroute"]
    assert alone["backend"] == "speculative" and alone["concurrency"] == 1
    core.load["plain"] = 60  # 60 requests in flight on the plain backend
    loaded = client.post(CHAT, json=chat_body()).json()["specroute"]
    assert loaded["backend"] != "speculative" and loaded["concurrency"] == 61
    assert any("concurrency 61" in r for r in loaded["reasons"])
    assert any("compute-bound" in r for r in loaded["reasons"])
    assert pool.backends() == ["speculative", loaded["backend"]]
    assert core.load["plain"] == 60  # the fake load is untouched; the request's own count came back


@pytest.mark.parametrize("backend", ["plain", "quantized", "speculative"])
def test_a_forced_backend_is_honoured(client, pool, core, backend):
    core.load["plain"] = 60  # the policy alone would not speculate
    body = chat_body(specroute={"backend": backend, "category": "copy"})
    info = client.post(CHAT, json=body).json()["specroute"]
    assert info["backend"] == backend and info["stage"] == "forced"
    assert info["reasons"][0].startswith(f"forced: the request asked for the {backend} backend")
    assert pool.backends() == [backend]
    assert (pool.calls[0][2] is not None) == (backend == "speculative")


def test_a_requested_drafter_is_passed_on(client, pool):
    body = chat_body(specroute={"category": "copy", "drafter": "model:draft@bfloat16"})
    info = client.post(CHAT, json=body).json()["specroute"]
    assert info["drafter"] == "model:draft@bfloat16" and pool.calls[0][2] == "model:draft@bfloat16"


def test_an_unknown_drafter_is_refused(client, pool):
    body = chat_body(specroute={"category": "copy", "drafter": "eagle"})
    assert "eagle" in assert_openai_error(client.post(CHAT, json=body), 400)["message"]
    assert not pool.calls


def test_the_default_max_tokens_never_exceeds_the_limit(tokenizer):
    client = TestClient(make_app(tokenizer, max_tokens=16, default_max_tokens=256))
    response = client.post(CHAT, json=without(chat_body(), "max_tokens"))
    assert response.status_code == 200, response.text


# -- 5. /v1/advise ---------------------------------------------------------------------------------


def test_advise_gives_a_decision_that_follows_concurrency(client, pool):
    body = {"prompt": "copy prompt 1", "max_tokens": 8, "specroute": {"category": "copy"}}
    response = client.post(ADVISE, json=body)
    assert response.status_code == 200, response.text
    alone = response.json()
    assert alone["backend"] == "speculative" and alone["reasons"] and alone["concurrency"] == 1
    assert {c["backend"] for c in alone["candidates"]} == {"speculative", "plain", "quantized"}
    busy = client.post(ADVISE, json={**body, "concurrency": 60}).json()
    assert busy["backend"] != "speculative" and busy["concurrency"] == 60
    assert not pool.calls  # advice runs nothing


def test_advise_takes_messages(client):
    body = {"messages": [{"role": "user", "content": "copy prompt 1"}], "max_tokens": 8}
    response = client.post(ADVISE, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["features"]["prompt_tokens"] > 0


def test_bad_advise_input_is_400(client):
    assert_openai_error(client.post(ADVISE, json={"prompt": "hi", "specroute": {"category": "poetry"}}), 400)
    bad_message = {"messages": [{"role": "robot", "content": "hi"}]}
    assert_openai_error(client.post(ADVISE, json=bad_message), 400)
    assert_openai_error(client.post(ADVISE, json={"prompt": "hi", "max_tokens": 0}), 400)
    assert_openai_error(client.post(ADVISE, json={"prompt": "hi", "concurrency": 200_000}), 400)


# -- 6. retry --------------------------------------------------------------------------------------


def test_a_failed_backend_is_finished_on_plain_without_losing_tokens(client, pool):
    pool.fail_after["speculative"] = 2
    response = client.post(CHAT, json=chat_body())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "".join(WORDS)
    usage = body["usage"]
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert body["specroute"]["retried"] is True
    assert pool.backends() == ["speculative", "plain"]
    _, resumed, drafter = pool.calls[1]
    assert resumed["resume_ids"] == pool.ids[0] + pool.ids[1] and drafter is None
    assert resumed["max_tokens"] == 8 - 2
    assert resumed["messages"] == pool.calls[0][1]["messages"]


def test_a_cache_salt_reaches_the_backend_and_a_bad_one_is_refused(client, pool):
    response = client.post(CHAT, json=chat_body(cache_salt="tenant-7"))
    assert response.status_code == 200, response.text
    assert pool.calls[-1][1]["cache_salt"] == "tenant-7"
    for bad in ("", "x" * 257, 7):
        response = client.post(CHAT, json=chat_body(cache_salt=bad))
        assert response.status_code == 400 and "cache_salt" in response.text, response.text


def test_a_failed_stream_is_finished_on_plain(client, pool, core):
    pool.fail_after["speculative"] = 3
    with client.stream("POST", CHAT, json=chat_body(stream=True)) as response:
        assert response.status_code == 200
        events = sse(response)
    assert events[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1])
    assert text == "".join(WORDS)  # each token sent exactly once
    assert events[-2]["specroute"]["retried"] is True
    assert pool.calls[1][1]["resume_ids"] == pool.ids[0] + pool.ids[1] + pool.ids[2]
    assert sum(core.load.values()) == 0


def test_every_attempt_failing_is_503(client, pool, core):
    pool.fail_after.update(speculative=0, plain=0)
    error = assert_openai_error(client.post(CHAT, json=chat_body()), 503)
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert pool.backends() == ["speculative", "plain"]  # Limits.retries = 1
    assert sum(core.load.values()) == 0


def test_every_attempt_failing_mid_stream_is_reported_in_band(client, pool):
    pool.fail_after.update(speculative=2, plain=0)
    with client.stream("POST", CHAT, json=chat_body(stream=True)) as response:
        assert response.status_code == 200
        events = sse(response)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error" and "RuntimeError" in events[-2]["error"]["message"]


def test_every_attempt_failing_after_the_first_token_is_503(app, pool):
    pool.fail_after.update(speculative=2, plain=0)
    response = TestClient(app, raise_server_exceptions=False).post(CHAT, json=chat_body())
    assert assert_openai_error(response, 503)["type"] == "server_error"


def test_a_backend_refusal_is_400_and_not_retried(client, pool):
    pool.error_after["speculative"] = (0, "the drafter cannot take this prompt")
    error = assert_openai_error(client.post(CHAT, json=chat_body()), 400)
    assert error["message"] == "the drafter cannot take this prompt"
    assert pool.backends() == ["speculative"]
    error = assert_openai_error(client.post(CHAT, json=chat_body(stream=True)), 400)  # before any SSE byte
    assert error["message"] == "the drafter cannot take this prompt"


def test_a_full_backend_is_retried_once_on_the_next_best_one(client, pool, core):
    pool.full["speculative"] = 3
    for stream in (False, True):
        body = ChatCompletionRequest.model_validate(chat_body())
        routed = core.route(core.prepare(body.generation(body.max_tokens or 256), body.specroute, len(body.messages)))
        others = [c for c in routed.decision.candidates if c.backend != "speculative"]
        expected = min(others, key=lambda c: c.latency_ms).backend
        response = client.post(CHAT, json=chat_body(stream=stream))
        assert response.status_code == 200, response.text
        info = sse(response)[-2]["specroute"] if stream else response.json()["specroute"]
        assert info["retried"] is True and info["backend"] == expected
        assert any(r.startswith("retried: the speculative backend was full") for r in info["reasons"])
        assert pool.backends()[-2:] == ["speculative", expected]
    assert sum(core.load.values()) == 0  # the full backend's attempt holds no in-flight count


def test_a_429_stands_when_the_next_best_backend_is_full_too_or_the_backend_was_forced(client, pool):
    pool.full.update({"speculative": 3, "plain": 3, "quantized": 3})
    for stream in (False, True):
        response = client.post(CHAT, json=chat_body(stream=stream))
        error = assert_openai_error(response, 429)
        assert response.headers["retry-after"] == "3" and "full" in error["message"]
        assert error["type"] == "rate_limit_error"
    assert len(pool.backends()) == 4  # each request tried two backends, no more
    pool.full = {"plain": 2}
    body = chat_body()
    body["specroute"] = {"backend": "plain"}
    assert_openai_error(client.post(CHAT, json=body), 429)
    assert pool.backends()[-1] == "plain" and len(pool.backends()) == 5


def test_the_static_baseline_is_asked_for_per_request(client, pool):
    body = chat_body()
    body["specroute"] = {"batching": "static"}
    assert client.post(CHAT, json=body).status_code == 200
    assert client.post(CHAT, json=chat_body()).status_code == 200
    assert pool.batching == ["static", "continuous"]


def test_a_backend_refusal_after_the_first_token_is_400(app, pool):
    pool.error_after["speculative"] = (2, "the drafter cannot take this prompt")
    response = TestClient(app, raise_server_exceptions=False).post(CHAT, json=chat_body())
    assert assert_openai_error(response, 400)["message"] == "the drafter cannot take this prompt"


# -- 7. policy hot reload --------------------------------------------------------------------------


def test_policy_reload_applies_and_a_bad_one_keeps_the_last_good(client, core):
    assert core.apply_policy({"speculation": {"enabled": False}}) is True
    info = client.post(CHAT, json=chat_body()).json()["specroute"]
    assert info["backend"] != "speculative"
    assert any("disabled by the policy" in r for r in info["reasons"])
    assert core.apply_policy({"speculation": {"enabled": "maybe"}}) is False
    health = client.get("/healthz").json()
    assert health["policy_error"] and "speculation.enabled" in health["policy_error"]
    assert health["policy"]["speculation"]["enabled"] is False  # the last good policy
    assert client.post(CHAT, json=chat_body()).json()["specroute"]["backend"] != "speculative"
    assert core.apply_policy(None) is True  # back to the defaults, error cleared
    assert client.get("/healthz").json()["policy_error"] is None
    assert client.post(CHAT, json=chat_body()).json()["specroute"]["backend"] == "speculative"


# -- 8. API key ------------------------------------------------------------------------------------


@pytest.fixture
def keyed(tokenizer) -> TestClient:
    return TestClient(make_app(tokenizer, api_key="secret"))


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer wrong"}, {"authorization": "secret"}, {"authorization": "Basic secret"},
     {"authorization": "Bearer secretsecret"}, {"authorization": "bearer"}],
    ids=["missing", "wrong", "no-scheme", "basic", "longer", "empty-bearer"],
)  # fmt: skip
@pytest.mark.parametrize(
    "method,path,body", [("POST", CHAT, chat_body()), ("POST", ADVISE, {"prompt": "hi"}), ("GET", "/v1/models", None)]
)
def test_a_missing_or_wrong_key_is_401(keyed, headers, method, path, body):
    kwargs = {"json": body} if body is not None else {}
    error = assert_openai_error(keyed.request(method, path, headers=headers, **kwargs), 401)
    assert error["code"] == "invalid_api_key"
    assert not keyed.app.state.core.pool.calls


def test_the_right_key_is_served_and_healthz_needs_none(keyed):
    good = {"authorization": "Bearer secret"}
    assert keyed.post(CHAT, json=chat_body(), headers=good).status_code == 200
    assert keyed.get("/v1/models", headers=good).status_code == 200
    assert keyed.get("/healthz").status_code == 200
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="secret", http_client=keyed, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    wrong = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=keyed, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key: send 'Authorization: Bearer"):
        wrong.models.list()


def test_the_key_is_checked_before_the_body(keyed):
    error = assert_openai_error(keyed.post(CHAT, content=b"not json"), 401)
    assert error["code"] == "invalid_api_key"


def test_405_says_which_methods_are_allowed(client):
    response = client.get(CHAT)
    assert response.status_code == 405 and response.headers.get("allow") == "POST"


# -- /report: the latest capacity-planning report -------------------------------------------------------


def test_report_is_a_404_saying_how_to_make_one_until_one_is_published(app, client, tmp_path):
    app.state.report_dir = tmp_path / "latest"
    response = client.get("/report")
    assert response.status_code == 404
    assert "run `specroute report --workload" in response.json()["error"]["message"]


def test_the_latest_published_report_is_served_read_only(app, client, tmp_path):
    from router.report import publish

    written = tmp_path / "out"
    written.mkdir()
    (written / "report.html").write_text("<html><body>first</body></html>")
    (written / "report.json").write_text('{"version": 1}')
    app.state.report_dir = publish(written, tmp_path / "latest")
    page = client.get("/report")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "first" in page.text
    assert client.get("/report.json").json() == {"version": 1}
    (written / "report.html").write_text("<html><body>second</body></html>")
    publish(written, tmp_path / "latest")  # a new report shows without a restart
    assert "second" in client.get("/report").text
    assert client.post("/report").status_code == 405


def test_report_needs_the_api_key(tokenizer, tmp_path):
    app = make_app(tokenizer, api_key="secret")
    app.state.report_dir = tmp_path
    (tmp_path / "report.html").write_text("<html>ok</html>")
    keyed = TestClient(app)
    assert keyed.get("/report").status_code == 401
    assert keyed.get("/report", headers={"Authorization": "Bearer secret"}).text == "<html>ok</html>"
