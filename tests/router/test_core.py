"""RouterCore alone: the policy only offers drafters the speculative backend serves, requests may
only name those, and in-flight counts rise and fall around a request."""

import asyncio

import pytest

from backends.errors import RequestError
from backends.generation import GenerationRequest, GenerationResult
from backends.models import load_tokenizer
from backends.speculative.stats import SpeculationStats
from backends.streaming import StreamEvent
from policies.config import PolicyConfig
from router.core import Limits, RouterCore
from router.schemas import SpecrouteOptions
from tests.policies.profiles import in_dtype, synthetic_profile


def one_token_result(text: str, token: int) -> GenerationResult:
    return GenerationResult(
        text=text,
        token_ids=[token],
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=1,
        ttft_s=0.01,
        tpot_s=0.0,
        seed=1,
    )


class OnePool:
    def __init__(self) -> None:
        self.seen_load: list[int] = []
        self.core: RouterCore | None = None

    async def stream(self, backend, request, drafter, batching="continuous"):
        self.seen_load.append(self.core.load[backend])
        yield StreamEvent(text="ok", token_ids=[1], result=one_token_result("ok", 1))


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


def test_a_prompt_sent_before_is_expected_cached_on_the_backend_it_went_to(tokenizer):
    pool = OnePool()
    router = RouterCore(synthetic_profile(), PolicyConfig(), tokenizer, pool, prefix_blocks=64)
    pool.core = router
    system = "You are a careful assistant. Answer briefly and name your sources. " * 4
    first = router.prepare(GenerationRequest(prompt=system + "What is rye?", max_tokens=8), SpecrouteOptions())
    routed = router.route(first)
    assert not routed.features.cached_tokens

    async def run(prepared, routed):
        return [e async for e in router.run(prepared, routed)]

    asyncio.run(run(first, routed))
    second = router.prepare(GenerationRequest(prompt=system + "And spelt?", max_tokens=8), SpecrouteOptions())
    again = router.route(second)
    cached = again.features.cached_tokens
    assert set(cached) == {routed.backend} and 0 < cached[routed.backend] < second.prompt_tokens
    assert any(r.startswith(f"prefix cache: the {routed.backend} backend holds about") for r in again.reasons)
    salted = second.request.model_copy(update={"cache_salt": "tenant"})
    assert not router.route(router.prepare(salted, SpecrouteOptions())).features.cached_tokens


class SpeculativePool:
    """Every request finishes on the given speculation statistics."""

    def __init__(self, stats: SpeculationStats) -> None:
        self.stats = stats

    async def stream(self, backend, request, drafter, batching="continuous"):
        result = one_token_result("ok", 1).model_copy(update={"speculation": self.stats})
        yield StreamEvent(text="ok", token_ids=[1], result=result)


def finish_speculative(tokenizer, stats: SpeculationStats, requests: int = 1) -> RouterCore:
    router = RouterCore(synthetic_profile(), PolicyConfig(), tokenizer, SpeculativePool(stats))

    async def run():
        prepared = router.prepare(*request())
        return [e async for e in router.run(prepared, router.route(prepared))]

    for _ in range(requests):
        asyncio.run(run())
    return router


def predicted(router: RouterCore, category: str = "prose") -> tuple[float, float]:
    """(α, ρ) the router's predictors give ngram on the test request's prompt."""
    text, tokens = "prose prompt 1", 40
    alpha = router.predictors.alpha.predict(text, 1, tokens, "ngram", category).alpha
    rho = router.predictors.proposal_rate.predict(text, 1, tokens, "ngram", category).alpha
    return alpha, rho


def test_finished_requests_correct_both_the_alpha_and_the_proposal_rate_predictions(tokenizer):
    # The synthetic profile measured ngram on prose at α 0.1 and ρ 1.0; these requests saw α 0.9, ρ 0.2.
    stats = SpeculationStats(
        drafter="ngram", k_mode="4", requested_steps=50, drafts=10, accepted_tokens=36, judged_tokens=40
    )
    untouched = finish_speculative(tokenizer, stats, requests=0)
    router = finish_speculative(tokenizer, stats, requests=5)
    (alpha_before, rho_before), (alpha_after, rho_after) = predicted(untouched), predicted(router)
    assert alpha_after > alpha_before + 0.1 and rho_after < rho_before - 0.1
    # A drafter that never proposed judged nothing, yet still says ρ was low; α is left alone.
    silent = stats.model_copy(update={"drafts": 0, "accepted_tokens": 0, "judged_tokens": 0})
    router = finish_speculative(tokenizer, silent, requests=5)
    alpha_silent, rho_silent = predicted(router)
    assert alpha_silent == alpha_before and rho_silent < rho_before - 0.1


def test_a_request_speculating_on_the_quantized_backend_shows_its_alpha_and_teaches_the_target_nothing(tokenizer):
    profile = synthetic_profile(quantized_agreement=0.99, quantized_alphas={"copy": 0.7, "prose": 0.1})
    stats = SpeculationStats(drafter="ngram", k_mode="auto", requested_steps=50, drafts=50, judged_tokens=40)
    router = RouterCore(profile, PolicyConfig(), tokenizer, SpeculativePool(stats))
    prepared = router.prepare(*request("copy"))
    routed = router.route(prepared)
    assert (routed.backend, routed.drafter, routed.predicted_alpha) == ("quantized", "ngram", 0.7)
    before = predicted(router, "copy")

    async def run():
        return [e async for e in router.run(prepared, routed)]

    asyncio.run(run())
    assert predicted(router, "copy") == before  # α 0 on the quantized model is not the target's


@pytest.mark.parametrize(("agreement", "below"), [(None, ["quantized"]), (0.90, ["quantized"]), (0.95, []), (0.99, [])])
def test_health_names_the_backends_under_the_policys_quality_floor(tokenizer, agreement, below):
    profile = synthetic_profile(quantized_agreement=agreement)
    router = RouterCore(profile, PolicyConfig(), tokenizer, OnePool())
    assert asyncio.run(router.health())["below_quality_floor"] == below  # the default floor is 95% agreement


class FailingPool:
    """Each backend fails its first `fails[backend]` attempts after one token; `live` is what its
    health reports."""

    def __init__(self, fails: dict[str, int], live: dict[str, str | None] | None = None) -> None:
        self.fails, self.live, self.calls = dict(fails), live or {}, []

    async def stream(self, backend, request, drafter, batching="continuous"):
        self.calls.append((backend, drafter, list(request.get("resume_ids") or [])))
        sent = len(request.get("resume_ids") or [])
        if self.fails.get(backend, 0) > 0:
            self.fails[backend] -= 1
            yield StreamEvent(text="a", token_ids=[sent + 1])
            raise RuntimeError(f"{backend} replica died")
        yield StreamEvent(text="b", token_ids=[sent + 1], result=one_token_result("b", sent + 1))

    async def health(self):
        return {b: self.live.get(b) for b in ("speculative", "plain", "quantized")}

    async def loop_snapshots(self):
        return []


def run_forced(router: RouterCore, backend: str) -> list[StreamEvent]:
    prepared = router.prepare(
        GenerationRequest(prompt="prose prompt 1", max_tokens=8), SpecrouteOptions(backend=backend)
    )
    routed = router.route(prepared)

    async def run():
        return [e async for e in router.run(prepared, routed)]

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("failed", "fails", "path"),
    [
        ("speculative", {"speculative": 1}, ["speculative", "plain"]),  # the exact backends stand in for each other
        ("plain", {"plain": 1}, ["plain", "speculative"]),
        ("plain", {"plain": 1, "speculative": 1}, ["plain", "speculative", "plain"]),
        ("quantized", {"quantized": 3}, ["quantized"] * 4),  # its tokens are its own: wait for a new replica
    ],
)
def test_a_failed_attempt_resumes_on_a_backend_giving_the_same_tokens(tokenizer, failed, fails, path):
    pool = FailingPool(fails)
    router = RouterCore(synthetic_profile(), PolicyConfig(), tokenizer, pool, Limits(retries=2))
    events = run_forced(router, failed)
    assert [c[0] for c in pool.calls] == path
    assert [c[2] for c in pool.calls] == [list(range(1, i + 1)) for i in range(len(path))]  # resumed, never repeated
    assert events[-1].result.token_ids == list(range(1, len(path) + 1)) and router.load.total() == 0


def test_a_quantized_request_finishes_on_plain_once_its_wait_is_over(tokenizer):
    pool = FailingPool({"quantized": 100})
    router = RouterCore(synthetic_profile(), PolicyConfig(), tokenizer, pool, Limits(retries=1, quantized_wait_s=0))
    events = run_forced(router, "quantized")
    assert [c[0] for c in pool.calls] == ["quantized", "plain"] and events[-1].result is not None


def test_health_is_degraded_while_a_backend_has_no_live_replica_or_a_policy_was_refused(tokenizer):
    pool = FailingPool({}, live={"plain": "no running replica"})
    router = RouterCore(synthetic_profile(), PolicyConfig(), tokenizer, pool)
    health = asyncio.run(router.health())
    assert health["status"] == "degraded" and health["problems"] == ["plain: no running replica"]
    assert health["backends"] == {"speculative": "live", "plain": "no running replica", "quantized": "live"}
    pool.live = {}
    assert asyncio.run(router.health())["status"] == "ok"
    assert not router.apply_policy({"speculation": {"enabled": "maybe"}}, "test")
    refused = asyncio.run(router.health())
    assert refused["status"] == "degraded" and "refused" in refused["problems"][0]


def test_a_finished_profile_replaces_the_provisional_one_and_a_wrong_one_is_refused(tokenizer, tmp_path):
    probe = synthetic_profile(quantized_agreement=0.97).model_copy(update={"provisional": True})
    router = RouterCore(probe, PolicyConfig(), tokenizer, OnePool())
    learned = router.predictors
    full, other = tmp_path / "full.json", tmp_path / "other.json"
    in_dtype(synthetic_profile(quantized_agreement=0.97), "bfloat16", 0.5).save(other)
    assert not router.apply_profile(other)
    assert router.profile is probe and "profiles SmolLM2-135M-Instruct in bfloat16" in router.profile_error
    assert not router.apply_profile(tmp_path / "missing.json") and "no profile at" in router.profile_error
    synthetic_profile(quantized_agreement=0.97).save(full)
    assert router.apply_profile(full)
    assert not router.profile.provisional and router.profile_error is None
    assert router.predictors is learned  # the same samples: what the predictors learned since is kept


class ReplicatedPool(OnePool):
    """Two replicas of every backend, the requests passed along as the backends get them."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[dict] = []

    def replica_counts(self) -> dict[str, int]:
        return {"speculative": 2, "plain": 2, "quantized": 2}

    async def stream(self, backend, request, drafter, batching="continuous"):
        self.requests.append(request)
        async for event in super().stream(backend, request, drafter, batching):
            yield event


def test_the_backend_gets_the_prompt_ids_and_the_policy_each_replicas_load(tokenizer):
    pool = ReplicatedPool()
    router = RouterCore(synthetic_profile(), PolicyConfig(), tokenizer, pool)
    pool.core = router
    prepared = router.prepare(*request())
    assert prepared.request.prompt_ids == prepared.prompt_ids == tokenizer("prose prompt 1").input_ids
    router.load["plain"] = 6  # over two replicas: the request joins a machine running three
    routed = router.route(prepared)
    assert routed.concurrency == 4

    async def run():
        return [e async for e in router.run(prepared, routed)]

    asyncio.run(run())
    assert pool.requests[0]["prompt_ids"] == prepared.prompt_ids


class TimedPool:
    """Every request answers ten tokens at `tpot_s[backend]` seconds each."""

    def __init__(self, tpot_s: dict[str, float]) -> None:
        self.tpot_s = tpot_s

    async def stream(self, backend, request, drafter, batching="continuous"):
        ids = list(range(1, 11))
        result = one_token_result("ok", 1).model_copy(
            update={"token_ids": ids, "completion_tokens": len(ids), "tpot_s": self.tpot_s[backend]}
        )
        yield StreamEvent(text="ok", token_ids=ids, result=result)


def test_finished_requests_calibrate_their_backends_time_per_token_and_the_next_decision_reads_it(tokenizer):
    from policies.calibration import predicted_tpot_ms

    profile = synthetic_profile(quantized_agreement=0.99)
    plain_ms = predicted_tpot_ms(profile, "plain", None, 1, 3, 10, (1, 8))
    quantized_ms = predicted_tpot_ms(profile, "quantized", None, 1, 3, 10, (1, 8))
    # The service runs plain 1.5× and the quantized backend 3× their profiled times.
    pool = TimedPool({"plain": 1.5 * plain_ms / 1e3, "quantized": 3.0 * quantized_ms / 1e3})
    config = PolicyConfig.model_validate({"speculation": {"enabled": False}, "calibration": {"enabled": True}})
    router = RouterCore(profile, config, tokenizer, pool)
    before, _ = router.decide(router.prepare(GenerationRequest(prompt="abc", max_tokens=10), SpecrouteOptions()))
    assert before.backend == "quantized"  # the profile has it 1.7× faster than plain
    for backend in ("plain", "quantized") * 3:
        run_forced(router, backend)
    summary = router.calibration.summary()
    assert summary["plain"][1]["requests"] == 3 and summary["quantized"][1]["requests"] == 3
    assert summary["quantized"][1]["tpot"] / summary["plain"][1]["tpot"] == pytest.approx(2.0, rel=0.1)
    assert summary["plain"][1]["ttft"] > 0  # the backend's reported TTFT over the profile's prefill
    after, _ = router.decide(router.prepare(GenerationRequest(prompt="abc", max_tokens=10), SpecrouteOptions()))
    assert after.backend == "plain"  # 1.7× predicted, 1.7 / 2 = 0.85× as this service runs it
    assert any(r.startswith("calibration: measured in this service") for r in after.reasons)
    assert asyncio.run(router.health())["calibration"] == summary
    # A new profile predicts differently: what was learned against the old one is dropped.
    router.calibration.clear()
    assert router.calibration.summary() == {}
