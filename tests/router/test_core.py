"""RouterCore alone: the policy only offers drafters the speculative backend serves, requests may
only name those, and in-flight counts rise and fall around a request."""

import asyncio

import pytest

from backends.errors import RequestError
from backends.generation import GenerationRequest, GenerationResult
from backends.models import load_tokenizer
from backends.streaming import StreamEvent
from policies.config import PolicyConfig
from router.core import RouterCore
from router.schemas import SpecrouteOptions
from tests.policies.profiles import synthetic_profile


class OnePool:
    def __init__(self) -> None:
        self.seen_load: list[int] = []
        self.core: RouterCore | None = None

    async def stream(self, backend, request, drafter, batching="continuous"):
        self.seen_load.append(self.core.load[backend])
        result = GenerationResult(
            text="ok",
            token_ids=[1],
            finish_reason="length",
            prompt_tokens=3,
            completion_tokens=1,
            ttft_s=0.01,
            tpot_s=0.0,
            seed=1,
        )
        yield StreamEvent(text="ok", token_ids=[1], result=result)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def core(tokenizer, served=None) -> tuple[RouterCore, OnePool]:
    pool = OnePool()
    router = RouterCore(synthetic_profile(), PolicyConfig(), tokenizer, pool, served_drafters=served)
    pool.core = router
    return router, pool


def request(category="prose") -> tuple[GenerationRequest, SpecrouteOptions]:
    return GenerationRequest(prompt="prose prompt 1", max_tokens=8), SpecrouteOptions(category=category)


def test_the_policy_only_offers_served_drafters(tokenizer):
    everything, _ = core(tokenizer)
    only_ngram, _ = core(tokenizer, served=["ngram"])
    prepared = everything.prepare(*request())
    offered = {c.drafter for c in everything.decide(prepared)[0].candidates if c.backend == "speculative"}
    assert offered == {"ngram", "model:draft@bfloat16"}
    narrowed = {c.drafter for c in only_ngram.decide(prepared)[0].candidates if c.backend == "speculative"}
    assert narrowed == {"ngram"}
    assert only_ngram.drafters == ["ngram"]
    with pytest.raises(RequestError, match="unknown drafter 'model'"):
        only_ngram.prepare(GenerationRequest(prompt="x", max_tokens=4), SpecrouteOptions(drafter="model"))


def test_no_served_drafter_means_no_speculation(tokenizer):
    router, _ = core(tokenizer, served=["early-exit"])
    decision, _ = router.decide(router.prepare(*request("copy")))
    assert decision.backend != "speculative"
    assert not [c for c in decision.candidates if c.backend == "speculative"]


def test_in_flight_counts_a_request_while_it_runs(tokenizer):
    router, pool = core(tokenizer)
    prepared = router.prepare(*request())
    routed = router.route(prepared)

    async def run():
        return [e async for e in router.run(prepared, routed)]

    events = asyncio.run(run())
    assert events[-1].result.text == "ok"
    assert pool.seen_load == [1] and router.load[routed.backend] == 0


@pytest.mark.parametrize(("agreement", "below"), [(None, ["quantized"]), (0.90, ["quantized"]), (0.95, []), (0.99, [])])
def test_health_names_the_backends_under_the_policys_quality_floor(tokenizer, agreement, below):
    profile = synthetic_profile(quantized_agreement=agreement)
    router = RouterCore(profile, PolicyConfig(), tokenizer, OnePool())
    assert router.health()["below_quality_floor"] == below  # the default floor is 95% agreement
