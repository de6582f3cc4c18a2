"""The step loop: requests join and leave a running batch at any step, prompts are prefilled in
chunks between decode steps, memory stays bounded, failures stay with their own request — and
every request's greedy tokens are exactly what the plain engine produces for it alone, for the
plain loop and every drafter, whatever else arrived, finished or left meanwhile (a property
checked over many random schedules); sampling keeps the target's distribution (χ²)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from backends import scheduler as scheduler_module
from backends.errors import RequestError
from backends.generation import GenerationRequest, GenerationResult
from backends.plain import PlainEngine
from backends.sampling import SamplingParams, target_probs
from backends.scheduler import LoopSettings, Scheduler
from backends.speculative.acceptance import NGRAM_FEATURES, constant_map
from backends.speculative.control import DraftCosts, StepCosts
from backends.speculative.drafters import Drafter, DraftRow, ModelDrafter, NgramDrafter
from backends.speculative.factory import build_drafter
from backends.speculative.lookahead import LookaheadDrafter
from policies.drafters import DrafterConfig
from profiler.workloads import load_prompt_set

from .conftest import BrokenDrafter, lookup, perturbed, tiny_model
from .speculative.test_engine import SAMPLING, _exact_joint, _matches_target

STOPS = ["\n\n", ".", " the", "ing", ","]


@dataclass
class Arrival:
    step: int
    request: GenerationRequest
    drafter: str | None = None


def run_schedule(scheduler: Scheduler, arrivals: list[Arrival]) -> list[GenerationResult]:
    """Submit each request at its step (fast-forwarding while the loop is idle); results in order."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].step)
    rows: dict[int, object] = {}
    step = 0
    while len(rows) < len(arrivals) or not scheduler.idle:
        while len(rows) < len(arrivals) and arrivals[order[len(rows)]].step <= step:
            i = order[len(rows)]
            rows[i] = scheduler.submit(arrivals[i].request, drafter=arrivals[i].drafter)
        if scheduler.idle and len(rows) < len(arrivals):
            step = arrivals[order[len(rows)]].step
            continue
        scheduler.step()
        step += 1
    for row in rows.values():
        assert row.error is None, row.error
    return [rows[i].state.result(scheduler.tokenizer) for i in range(len(arrivals))]


def _prompt_pool() -> list[GenerationRequest]:
    """Prompts of very different lengths: the prompt set's (one per category), two raw ones, and a
    long document that takes many prefill chunks."""
    prompts = [c.prompts[0].messages for c in load_prompt_set().categories.values()]
    pool = [GenerationRequest(messages=m) for m in prompts]
    pool += [GenerationRequest(prompt="1, 2, 3, 4, 5,"), GenerationRequest(prompt="def fibonacci(n):")]
    document = " ".join(m.content for messages in prompts[:2] for m in messages)  # ~220 tokens
    pool.append(GenerationRequest(messages=[{"role": "user", "content": f"Summarise, reusing its words: {document}"}]))
    return pool


def random_schedule(seed: int, pool: list[GenerationRequest], count: int, drafters: list[str | None]) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals = []
    for _ in range(count):
        update = {"max_tokens": rng.randint(1, 20)}
        if rng.random() < 0.4:
            update["stop"] = [rng.choice(STOPS)]
        request = rng.choice(pool).model_copy(update=update)
        arrivals.append(Arrival(rng.randint(0, 24), request, rng.choice(drafters)))
    return arrivals


class _References:
    """The plain engine's output for a request decoded alone, computed once per distinct request."""

    def __init__(self, engine: PlainEngine):
        self.engine, self.known = engine, {}

    def __call__(self, request: GenerationRequest) -> list[int]:
        key = request.model_dump_json()
        if key not in self.known:
            self.known[key] = self.engine.generate([request])[0].token_ids
        return self.known[key]


@pytest.fixture(scope="module")
def references(engine) -> _References:
    return _References(engine)


@pytest.fixture(scope="module")
def tiny_references(tiny_target) -> _References:
    return _References(PlainEngine(tiny_target))


@pytest.fixture(scope="module")
def pool() -> list[GenerationRequest]:
    return _prompt_pool()


# Small budgets so that schedules exercise chunked prefill, waiting for a row and waiting for memory.
TIGHT = LoopSettings(max_batch=4, max_step_tokens=96, prefill_chunk=40, kv_cache_tokens=1536)


def _drafters(kind: str, loaded) -> list[Drafter]:
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    layers = loaded.model.config.num_hidden_layers
    if kind == "plain":
        return []
    if kind == "ngram":
        return [build_drafter(DrafterConfig(kind="ngram", ngram_max=4, ngram_min=1), loaded)]
    if kind == "early-exit":
        return [build_drafter(DrafterConfig(kind="early-exit", exit_layer=min(4, layers - 1)), loaded)]
    if kind == "random-model":  # almost never agrees: every step rejects, resamples and rolls back
        return [ModelDrafter(tiny_model(vocab, seed=5), vocab)]
    if kind == "agreeing-model":  # the target plus noise: drafts accepted up to a point, then rolled back
        return [ModelDrafter(perturbed(loaded.model, noise=0.4, seed=9), vocab)]
    if kind == "ngram+early-exit":  # two drafters in one loop, as the speculative backend runs them
        return _drafters("ngram", loaded) + _drafters("early-exit", loaded)
    return [build_drafter(DrafterConfig(kind=kind), loaded)]


def _check_schedules(
    loaded, pool, references, kind: str, seeds: tuple[int, ...], costs: StepCosts | None = None
) -> tuple[int, int]:
    """Random schedules of `kind`'s loop against decoding alone; drafted tokens (accepted, rejected).
    `costs`: the target's step-cost table, where one is at hand (else each loop probes its own)."""
    drafters, accepted, rejected = _drafters(kind, loaded), 0, 0
    names: list[str | None] = [d.name for d in drafters] or [None]
    for seed in seeds:  # odd seeds plan k per step (as the service does), even ones draft a fixed k
        k = "auto" if seed % 2 else 3
        scheduler = Scheduler(loaded, TIGHT, [d.fresh() for d in drafters], k=k, costs=costs)
        arrivals = random_schedule(seed, pool, 7, names)
        results = run_schedule(scheduler, arrivals)
        for i, (arrival, result) in enumerate(zip(arrivals, results, strict=True)):
            assert result.token_ids == references(arrival.request), f"seed {seed}, request {i}"
        assert scheduler.cache.sequences == {}  # every row left and gave its blocks back
        for totals in scheduler.drafter_totals.values():
            accepted += totals.accepted_tokens
            rejected += totals.draft_tokens - totals.accepted_tokens
    return accepted, rejected


# Loop logic, on the tiny target: drafts accepted in part, rejected outright, two drafters in one loop.
TINY_KINDS = ["plain", "early-exit", "random-model", "agreeing-model", "ngram+early-exit"]
# On the embedded model: the drafters that need real text to propose (prompt lookup, lookahead's
# n-grams) or real weights (the shipped trained drafters).
EMBEDDED_KINDS = ["ngram", "lookahead", "eagle", "medusa", "early-exit-adapter"]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_greedy_output_is_the_plain_engines_whatever_joins_or_leaves(tiny_target, pool, tiny_references, kind):
    accepted, rejected = _check_schedules(tiny_target, pool, tiny_references, kind, seeds=(0, 1))
    if kind not in ("plain", "random-model"):
        assert accepted > 10 and rejected > 10  # both paths ran, mid-schedule


@pytest.mark.slow
@pytest.mark.parametrize("kind", EMBEDDED_KINDS)
def test_embedded_model_greedy_output_is_the_plain_engines_whatever_joins_or_leaves(
    loaded, pool, references, costs, kind
):
    # Odd seeds plan k per step (as the service does); prompt lookup also at a fixed k, on real text.
    # Lookahead's block is wider than the shared table's passes: its loop probes its own.
    shared = costs if kind != "lookahead" else None
    _check_schedules(loaded, pool, references, kind, seeds=(0, 1) if kind == "ngram" else (1,), costs=shared)


def test_many_schedules_of_the_plain_loop_match_decoding_alone(tiny_target, pool, tiny_references):
    settings = LoopSettings(max_batch=6, max_step_tokens=64, prefill_chunk=24, kv_cache_tokens=2048)
    for seed in range(10, 14):
        scheduler = Scheduler(tiny_target, settings)
        arrivals = random_schedule(seed, pool, 6, [None])
        results = run_schedule(scheduler, arrivals)
        assert [r.token_ids for r in results] == [tiny_references(a.request) for a in arrivals], f"seed {seed}"


# ---- prefix caching ----

SYSTEM = (
    "You are a careful assistant for a bakery. Answer in one short sentence, name the bread, and never "
    "mention prices. Opening hours are from seven to three."
)


def _shared_prefix_pool() -> list[GenerationRequest]:
    """Requests that share prefixes as traffic does: one system prompt before different questions,
    a conversation's next turns carrying its history, and raw prompts that extend one another."""
    questions = ["Which bread is the softest?", "What do you bake on Sundays?", "Is rye bread sour?"]
    history: list[dict] = [{"role": "system", "content": SYSTEM}]
    pool = []
    for question in questions:
        history = [*history, {"role": "user", "content": question}]
        pool.append(GenerationRequest(messages=[history[0], history[-1]]))
        pool.append(GenerationRequest(messages=history))
        history = [*history, {"role": "assistant", "content": "The baker says it depends on the flour."}]
    document = "Bread rises because yeast turns sugar into gas. " * 6
    pool += [GenerationRequest(prompt=document + tail) for tail in ("Summary:", "Question: why does it rise?")]
    return pool


# A pool two long prompts overfill: rows are preempted and cached blocks evicted.
SCARCE = TIGHT.model_copy(update={"kv_cache_tokens": 256})


@pytest.mark.parametrize("settings", [TIGHT, SCARCE], ids=["tight", "scarce"])
@pytest.mark.parametrize("kind", ["plain", "agreeing-model", "early-exit"])
def test_prefix_hits_and_preemptions_leave_greedy_output_unchanged(tiny_target, tiny_references, kind, settings):
    """Random arrivals of requests sharing prefixes: every answer is the plain engine's alone,
    later requests start from cached blocks, and in a scarce pool rows are preempted and resumed."""
    drafters, pool = _drafters(kind, tiny_target), _shared_prefix_pool()
    names: list[str | None] = [d.name for d in drafters] or [None]
    preemptions = 0
    for seed in (3, 4):
        scheduler = Scheduler(tiny_target, settings, [d.fresh() for d in drafters], k="auto" if seed % 2 else 3)
        arrivals = random_schedule(seed, pool, 10, names)
        if settings is SCARCE:  # long answers: rows outgrow what admission left them
            for arrival in arrivals:
                arrival.request = arrival.request.model_copy(update={"max_tokens": 64, "ignore_eos": True})
        results = run_schedule(scheduler, arrivals)
        for i, (arrival, result) in enumerate(zip(arrivals, results, strict=True)):
            assert result.token_ids == tiny_references(arrival.request), f"seed {seed}, request {i}"
        hits = [r.cached_tokens for r in results]
        found = scheduler.cache.prefix_stats.hits  # with a resumed row's lookups, which its usage does not count
        assert any(hits) and (sum(hits) == found if not scheduler.preemptions else sum(hits) <= found), hits
        assert all(h < r.prompt_tokens for h, r in zip(hits, results, strict=True))
        assert scheduler.cache.sequences == {} and scheduler.cache.usage == 0
        preemptions += scheduler.preemptions
    assert (preemptions > 0) == (settings is SCARCE)


def test_requests_arriving_together_compute_their_shared_prompt_once(tiny_target, tiny_references, monkeypatch):
    """Admitted in one step, nobody finds anything cached; still, a row waits a step rather than
    compute the block an older row computes, and then takes it from the cache."""
    questions = ["Which bread is the softest?", "What do you bake on Sundays?", "Is rye sour?", "Why rise?"]
    requests = [
        GenerationRequest(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in questions
    ]
    fed: dict[bool, int] = {}
    cached: dict[bool, list[int]] = {}
    for caching in (True, False):
        scheduler = Scheduler(tiny_target, TIGHT.model_copy(update={"prefix_caching": caching}))
        prefill, tokens = scheduler.cache.last_logits, []

        def spy(seqs, blocks, prefill=prefill, tokens=tokens):
            tokens.append(sum(len(b) for b in blocks))
            return prefill(seqs, blocks)

        monkeypatch.setattr(scheduler.cache, "last_logits", spy)
        results = scheduler.generate(requests)
        assert [r.token_ids for r in results] == [tiny_references(r) for r in requests]
        fed[caching], cached[caching] = sum(tokens), [r.cached_tokens for r in results]
    prompts = sum(r.prompt_tokens for r in results)
    assert cached[False] == [0] * 4 and fed[False] == prompts
    assert cached[True][0] == 0 and all(c > 0 for c in cached[True][1:])
    assert fed[True] == prompts - sum(cached[True]) < 0.5 * prompts


def test_prefix_caching_off_and_other_salts_find_nothing(tiny_target):
    request = GenerationRequest(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
    salted = [request.model_copy(update={"cache_salt": salt}) for salt in ("a", "b", "a")]
    scheduler = Scheduler(tiny_target, LoopSettings())
    assert [scheduler.generate([r])[0].cached_tokens > 0 for r in [request, request, *salted]] == [
        False,
        True,
        False,  # the first of salt "a": nothing of an unsalted prompt is shared with it
        False,
        True,
    ]
    off = Scheduler(tiny_target, LoopSettings(prefix_caching=False))
    assert [off.generate([request])[0].cached_tokens for _ in range(2)] == [0, 0]
    assert off.cache.prefix_stats.queries == 0


def test_only_float32_targets_keep_a_prefix_cache(tiny_target, tiny_target_bf16):
    # bfloat16 (and torch's int kernels) round a token's keys differently by prefill chunk: a hit could change tokens
    assert Scheduler(tiny_target, LoopSettings()).cache.prefix_caching
    assert not Scheduler(tiny_target_bf16, LoopSettings()).cache.prefix_caching


def test_a_drafter_reading_the_targets_hidden_states_prefills_its_rows_in_full(tiny_target, monkeypatch):
    drafter = lookup()
    monkeypatch.setattr(drafter, "feature_layers", (1,))  # as EAGLE and Medusa read them
    monkeypatch.setattr(drafter, "observe_target", lambda rows, features: None)
    scheduler = Scheduler(tiny_target, LoopSettings(), [drafter], k=2)
    request = GenerationRequest(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
    assert [scheduler.generate([request], drafters=[d])[0].cached_tokens > 0 for d in ("plain", None, None)] == [
        False,
        False,  # its features of the cached positions were never computed
        False,
    ]
    assert scheduler.generate([request], drafters=["plain"])[0].cached_tokens > 0  # the blocks were cached


# ---- scheduling, on a tiny model ----


def _tiny_scheduler(tiny_target, settings: LoopSettings, drafters=()) -> Scheduler:
    return Scheduler(tiny_target, settings, list(drafters), k=2)


def _request(tokens: int, text: str = "Hello there", **fields) -> GenerationRequest:
    return GenerationRequest(prompt=text, max_tokens=tokens, ignore_eos=True, **fields)


def test_a_long_prompt_is_prefilled_in_chunks_while_running_streams_keep_decoding(tiny_target, monkeypatch):
    settings = LoopSettings(max_batch=4, max_step_tokens=64, prefill_chunk=32)
    scheduler = _tiny_scheduler(tiny_target, settings)
    widths = []
    forward = scheduler.cache.forward

    def spy(seqs, blocks, width=None, keep="all", **inputs):
        widths.append(max(len(b) for b in blocks))
        return forward(seqs, blocks, width, keep, **inputs)

    monkeypatch.setattr(scheduler.cache, "forward", spy)
    short = scheduler.submit(_request(40))
    scheduler.step()
    long_prompt = " ".join(["word"] * 600)
    long = scheduler.submit(_request(4, long_prompt))
    produced = []
    while not long.state.token_ids:
        scheduler.step()
        produced.append(len(short.state.token_ids))
    prompt_tokens = len(long.state.prompt_ids)
    assert prompt_tokens > 10 * 32 and max(widths) <= 32
    assert len(produced) >= prompt_tokens // 32  # the prompt took many steps …
    assert produced == list(range(produced[0], produced[0] + len(produced)))  # … each one a token for the short row


def test_no_more_than_max_batch_run_and_the_rest_wait_in_order(tiny_target):
    scheduler = _tiny_scheduler(tiny_target, LoopSettings(max_batch=2))
    rows = [scheduler.submit(_request(3 + i)) for i in range(5)]
    admitted_order, peak = [], 0
    while not scheduler.idle:
        scheduler.step()
        peak = max(peak, len(scheduler.running))
        admitted_order += [r.key for r in scheduler.running if r.key not in admitted_order]
    assert peak == 2 and admitted_order == [r.key for r in rows]
    assert all(len(r.state.token_ids) == 3 + i for i, r in enumerate(rows))


def test_memory_is_promised_lazily_and_the_newest_row_is_preempted_when_it_runs_out(tiny_target, tiny_references):
    settings = LoopSettings(max_batch=8, kv_cache_tokens=64)  # four blocks of 16 tokens
    scheduler = _tiny_scheduler(tiny_target, settings)
    requests = [_request(40), _request(40, "Good morning")]
    first, second = (scheduler.submit(r) for r in requests)
    scheduler.step()
    assert scheduler.running == [first, second]  # 2 × ~45 tokens > 64, but neither holds that yet
    paused = None
    while not first.done:
        scheduler.step()
        if second in scheduler.waiting and paused is None:
            paused = list(second.state.token_ids)  # preempted: its tokens so far are kept
            assert paused and second.resume == [*second.state.prompt_ids, *paused[:-1]] and second.seq == -1
    assert paused is not None and scheduler.preemptions >= 1
    while not second.done:
        scheduler.step()
    assert second.state.token_ids[: len(paused)] == paused  # it went on from where it was
    for row, request in zip((first, second), requests, strict=True):
        assert row.state.token_ids == tiny_references(request) and row.error is None
    assert scheduler.cache.usage == 0
    with pytest.raises(RequestError, match="KV cache"):
        scheduler.submit(_request(100))  # could never fit: refused at once, not queued forever


def test_a_preempted_row_whose_drafter_reads_hidden_states_is_told_them_again(tiny_target, monkeypatch):
    drafter, told, released = lookup(), {}, []

    def observe_target(rows, features) -> None:
        for row, f in zip(rows, features, strict=True):
            told[row.key] = told.get(row.key, 0) + len(f)

    def release(key: int) -> None:
        released.append(key)
        told.pop(key, None)

    monkeypatch.setattr(drafter, "feature_layers", (1,))  # as EAGLE and Medusa read them
    monkeypatch.setattr(drafter, "observe_target", observe_target)
    monkeypatch.setattr(drafter, "release", release)
    scheduler = Scheduler(tiny_target, LoopSettings(max_batch=8, kv_cache_tokens=64), [drafter], k=2)
    rows = [scheduler.submit(_request(40, text)) for text in ("Hello there", "Good morning")]
    while not all(r.done for r in rows):
        scheduler.step()
        for row in scheduler.running:  # every verified position's features, exactly once since it (re)joined
            assert told.get(row.key, 0) == scheduler.cache.length(row.seq), row.key
    assert scheduler.preemptions >= 1 and released.count(rows[1].key) >= 2  # preempted, then finished


def test_a_preempted_request_cancelled_while_it_waits_leaves_nothing_behind(tiny_target):
    drafter = lookup()
    scheduler = Scheduler(tiny_target, LoopSettings(max_batch=8, kv_cache_tokens=64), [drafter], k=2)
    first, second = (scheduler.submit(_request(40, text)) for text in ("Hello there", "Good morning"))
    while second.resume is None:  # until it is preempted, having produced tokens
        scheduler.step()
    assert second.seq == -1 and second.key in drafter.indexes  # it drafted before it was preempted
    scheduler.cancel(second)
    scheduler.step()
    assert second.done and second.key not in drafter.indexes and second not in scheduler.waiting
    while not first.done:
        scheduler.step()
    assert scheduler.cache.usage == 0


def test_a_cancelled_request_leaves_at_the_next_step_and_frees_its_blocks(tiny_target):
    scheduler = _tiny_scheduler(tiny_target, LoopSettings())
    stay, leave = scheduler.submit(_request(30)), scheduler.submit(_request(30))
    for _ in range(3):
        scheduler.step()
    scheduler.cancel(leave)
    scheduler.step()
    assert leave.done and leave.seq not in scheduler.cache.sequences and scheduler.running == [stay]
    waiting = scheduler.submit(_request(5))
    scheduler.cancel(waiting)  # gone before it was admitted
    while not scheduler.idle:
        scheduler.step()
    assert len(stay.state.token_ids) == 30 and waiting.state.token_ids == []


@pytest.mark.parametrize("where", ["propose", "observe"])
def test_a_failing_drafter_ends_only_its_own_requests(tiny_target, where):
    scheduler = Scheduler(tiny_target, LoopSettings(), [lookup(), BrokenDrafter(where)], k=2)
    failures = []
    good = scheduler.submit(_request(12), drafter="ngram")
    bad = scheduler.submit(_request(12), drafter="broken", on_failure=failures.append)
    plain = PlainEngine(tiny_target).generate([_request(12)])[0]
    while not scheduler.idle:
        scheduler.step()
    assert [str(e) for e in failures] == ["drafter broke"] and bad.error is failures[0]
    assert good.error is None and good.state.token_ids == plain.token_ids
    assert scheduler.cache.sequences == {}


def test_a_drafter_that_cannot_release_a_row_costs_nobody_their_answer(tiny_target):
    scheduler = Scheduler(tiny_target, LoopSettings(), [BrokenDrafter("release")], k=2)
    first, second = scheduler.submit(_request(6)), scheduler.submit(_request(12))
    plain = PlainEngine(tiny_target).generate([_request(6), _request(12)])
    while not scheduler.idle:
        scheduler.step()
    assert first.error is None and second.error is None
    assert [first.state.token_ids, second.state.token_ids] == [r.token_ids for r in plain]
    assert scheduler.cache.sequences == {}


def test_a_loop_that_fails_mid_generate_leaves_no_rows_behind(tiny_target, monkeypatch):
    scheduler = _tiny_scheduler(tiny_target, LoopSettings())
    monkeypatch.setattr(scheduler, "_decode", lambda rows: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        scheduler.generate([_request(4), _request(4)])
    assert scheduler.idle and scheduler.cache.sequences == {}
    monkeypatch.undo()
    assert len(scheduler.generate([_request(4)])[0].token_ids) == 4  # the loop serves on


def test_a_failing_listener_ends_only_its_own_request(tiny_target):
    scheduler = _tiny_scheduler(tiny_target, LoopSettings())

    def listener(state, token):
        if len(state.token_ids) == 3:
            raise ValueError("client went away")

    good = scheduler.submit(_request(8))
    bad = scheduler.submit(_request(8), listener=listener)
    while not scheduler.idle:
        scheduler.step()
    assert isinstance(bad.error, ValueError) and len(bad.state.token_ids) == 3
    assert good.error is None and len(good.state.token_ids) == 8


def test_unknown_drafters_and_drafting_on_a_plain_loop_are_refused(tiny_target):
    with pytest.raises(RequestError, match="unknown drafter"):
        Scheduler(tiny_target, LoopSettings(), [NgramDrafter()]).submit(_request(2), drafter="medusa")
    with pytest.raises(RequestError, match="does not draft"):
        Scheduler(tiny_target, LoopSettings()).submit(_request(2), drafter="ngram")
    with pytest.raises(ValueError, match=r"drafter names must differ \(got \['ngram', 'ngram'\]\)"):
        Scheduler(tiny_target, LoopSettings(), [lookup(), lookup(ngram_min=1)])


def _costs(curve) -> StepCosts:
    """A step-cost table from a closed form t(b, w), no probing."""
    return StepCosts(lambda batch, widths: {w: curve(batch, w) for w in widths}, max_width=9)


@pytest.mark.slow
def test_the_speculative_loop_turns_into_a_plain_batcher_when_the_batch_is_compute_bound(loaded):
    # Memory-bound at small batch (a wide pass costs little more), compute-bound from 8 rows on.
    def curve(batch, width):
        return 0.05 * (1 + 0.02 * (width - 1)) if batch < 8 else 0.05 * batch / 8 * width

    # The real model continues the pattern, so prompt lookup proposes at every step, alone or not.
    text = "red green blue red green blue red green blue red green blue"
    scheduler = Scheduler(loaded, LoopSettings(), [NgramDrafter(max_n=3, min_n=1)], k="auto", costs=_costs(curve))
    alone = scheduler.generate([_request(20, text)])[0]
    crowd = scheduler.generate([_request(20, text) for _ in range(16)])
    assert max(alone.speculation.k_history) > 0  # alone, drafting pays
    assert all(k == 0 for r in crowd for k in r.speculation.k_history)  # 16 rows: every step a plain step
    assert sum(r.speculation.declined_tokens for r in crowd) > 0  # the free drafter proposed all the same


@pytest.mark.slow
def test_a_map_that_expects_nothing_is_still_probed_and_the_tokens_stay_plain_decodings(loaded, monkeypatch):
    """A drafter's map that predicts ~0 for every proposal makes auto k decline them all, and with
    nothing verified nothing would ever correct it: every 8th declined proposal is verified anyway
    where a wide pass is cheap (here every width), and the tokens stay plain decoding's."""
    text = "red green blue red green blue red green blue red green blue"
    flat = _costs(lambda batch, width: 0.05 * (1 + 0.02 * (width - 1)))
    hopeless = constant_map("ngram", NGRAM_FEATURES, 0.001, samples=10**6)  # too many to be refitted here

    def run() -> GenerationResult:
        drafter = lookup(ngram_max=3, ngram_min=1)
        scheduler = Scheduler(
            loaded, LoopSettings(), [drafter], "auto", costs=flat, acceptance_maps={"ngram": hopeless}
        )
        return scheduler.generate([_request(48, text)])[0]

    probed = run()
    monkeypatch.setattr(scheduler_module, "_explore", lambda row, verified, probe: verified)
    stuck = run()
    assert all(k == 0 for k in stuck.speculation.k_history) and stuck.speculation.declined_tokens > 0
    probes = [k for k in probed.speculation.k_history if k]
    assert len(probes) >= 3 and probed.speculation.accepted_tokens > 0
    assert probed.token_ids == stuck.token_ids


def test_auto_k_asks_a_drafter_that_costs_more_than_it_saves_for_nothing(tiny_target, monkeypatch):
    """A drafter that runs a model is asked for the k the planner chose, not its cap: with a draft
    step measured at ten target passes, that is none, every step."""
    monkeypatch.setattr(DraftCosts, "record", lambda *args, **kwargs: None)
    drafter = ModelDrafter(perturbed(tiny_target.model, noise=0.4, seed=9), tiny_target.model.config.vocab_size)
    scheduler = Scheduler(tiny_target, LoopSettings(), [drafter], k="auto", costs=_costs(lambda b, w: 0.01))
    scheduler.drafter_costs[drafter.name] = DraftCosts(step_s={b: 0.1 for b in (1, 2, 4, 8)})
    result = scheduler.generate([_request(12)])[0]
    assert result.speculation.k_history and all(k == 0 for k in result.speculation.k_history)
    assert scheduler.drafter_totals[drafter.name].draft_tokens == 0


def test_sampled_rows_joining_and_leaving_keep_the_targets_distribution(tiny_target):
    """Tokens 2 and 3 of a prompt, sampled while other requests arrive at random steps and finish
    early (speculative loop, a mostly agreeing draft model): χ² against the exact joint."""
    vocab = tiny_target.model.config.vocab_size
    drafter = ModelDrafter(perturbed(tiny_target.model, noise=0.4, seed=9), vocab)
    scheduler = Scheduler(tiny_target, LoopSettings(max_batch=6), [drafter], k=2)
    # Long enough for full KV blocks: most rows start from the prefix cache, the first of a batch does not.
    prompt = "Once upon a time, in a small town by the sea, there lived a baker"
    samples = _sampled_among_others(scheduler, prompt, ["A much longer prompt about something else entirely", "Hi"], 8)
    totals = scheduler.drafter_totals[drafter.name]
    assert 0.1 * totals.draft_tokens < totals.accepted_tokens < 0.95 * totals.draft_tokens  # both paths ran
    assert 0 < scheduler.cache.prefix_stats.hits < scheduler.cache.prefix_stats.queries
    assert _matches_target(samples, _exact_joint(tiny_target, tiny_target.tokenizer(prompt).input_ids, SAMPLING))


def _sampled_among_others(scheduler: Scheduler, prompt: str, others: list[str], rows: int) -> list[tuple[int, int]]:
    """Tokens 2 and 3 of `prompt`, sampled by 5 rows of each of 300 batches in which `rows` - 5
    other requests arrive at random steps and finish early."""
    rng, samples = random.Random(0), []
    for batch in range(300):
        arrivals = [
            Arrival(
                rng.randint(0, 3),
                GenerationRequest(
                    prompt=prompt if row < 5 else rng.choice(others),
                    max_tokens=4 if row < 5 else rng.randint(1, 6),
                    ignore_eos=True,
                    sampling=SAMPLING.model_copy(update={"seed": batch * 10 + row}),
                ),
            )
            for row in range(rows)
        ]
        results = run_schedule(scheduler, arrivals)
        samples += [tuple(r.token_ids[1:3]) for r in results[:5]]
    return samples


class _PrimedLookahead(LookaheadDrafter):
    """Lookahead whose pool starts with given n-grams, so the very first steps verify several
    candidates — accepted, rejected and partly accepted ones."""

    def __init__(self, ngrams: list[list[int]]):
        super().__init__(window=2, ngram=3, guesses=4)
        self.ngrams = ngrams

    def _state(self, row: DraftRow):
        fresh = row.key not in self._rows
        state = super()._state(row)
        for ngram in self.ngrams if fresh else ():
            state.pool.add(ngram)
        return state

    def fresh(self) -> _PrimedLookahead:
        return self._named_as_me(_PrimedLookahead(self.ngrams))


def test_sampled_lookahead_rows_keep_the_targets_distribution(tiny_target):
    """Tokens 2 and 3 of a prompt sampled by lookahead while other requests come and go: the pool
    starts with the target's likeliest continuations of every possible first token (and one
    unlikely one each), so they are verified by the multi-candidate rule; χ² against the exact joint."""
    prompt = "Once upon a time"
    ids = tiny_target.tokenizer(prompt).input_ids
    model = tiny_target.model
    ngrams = []
    with torch.inference_mode():
        p1 = target_probs(model(input_ids=torch.tensor([ids])).logits[:, -1], [SAMPLING])[0]
        for x1 in p1.nonzero().flatten().tolist():
            p2 = target_probs(model(input_ids=torch.tensor([[*ids, x1]])).logits[:, -1], [SAMPLING])[0]
            for x2 in p2.topk(2).indices.tolist():
                x3 = int(model(input_ids=torch.tensor([[*ids, x1, x2]])).logits[0, -1].argmax())
                ngrams.append([x1, x2, x3])
            ngrams.append([x1, int(p2.argmin()), x1])  # never accepted
    drafter = _PrimedLookahead(ngrams)
    scheduler = Scheduler(tiny_target, LoopSettings(max_batch=6), [drafter], k=2)
    samples = _sampled_among_others(scheduler, prompt, ["A much longer prompt about something else entirely"], 7)
    totals = scheduler.drafter_totals[drafter.name]
    assert 0.1 * totals.draft_tokens < totals.accepted_tokens < 0.95 * totals.draft_tokens  # both paths ran
    assert _matches_target(samples, _exact_joint(tiny_target, ids, SAMPLING))


@pytest.mark.parametrize("k", [0, 3])
def test_a_seeded_sample_is_the_same_whatever_it_is_batched_with(tiny_target, k):
    vocab = tiny_target.model.config.vocab_size
    sampling = SamplingParams(temperature=1.0, top_k=6, seed=11)
    request = GenerationRequest(prompt="Hello there", max_tokens=16, ignore_eos=True, sampling=sampling)

    def loop() -> Scheduler:
        drafter = ModelDrafter(perturbed(tiny_target.model, noise=0.4, seed=9), vocab)
        return Scheduler(tiny_target, LoopSettings(), [drafter], k=k)

    alone = loop().generate([request])[0]
    others = [
        Arrival(step, _request(n, "Something else, longer", sampling=sampling.model_copy(update={"seed": step})))
        for step, n in ((0, 5), (2, 30), (6, 3))
    ]
    mixed = run_schedule(loop(), [Arrival(3, request), *others])[0]
    assert mixed.token_ids == alone.token_ids and mixed.seed == 11
    if k == 0:  # plain steps draw exactly what the plain engine draws
        assert PlainEngine(tiny_target).generate([request])[0].token_ids == alone.token_ids


def test_ttft_counts_the_wait_for_a_row(tiny_target):
    scheduler = _tiny_scheduler(tiny_target, LoopSettings(max_batch=1))
    first, second = scheduler.submit(_request(20)), scheduler.submit(_request(2))
    while not scheduler.idle:
        scheduler.step()
    a, b = first.state.result(scheduler.tokenizer), second.state.result(scheduler.tokenizer)
    assert b.ttft_s > a.ttft_s + 19 * a.tpot_s  # its clock ran while the first request held the only row


@pytest.mark.parametrize(
    ("mode", "dtype", "tile"),
    [
        ("auto", "bfloat16", 9),
        ("auto", "float16", 9),
        ("auto", "float32", None),
        ("on", "float32", 9),
        ("off", "bfloat16", None),
    ],
)
def test_passes_are_width_invariant_in_reduced_precision_unless_told(mode, dtype, tile):
    assert LoopSettings(width_invariant=mode).tile(dtype) == tile


def test_only_a_lone_sequences_passes_are_tiled_unless_told(tiny_target):
    """The loop's cache tiles what `tile_max_rows` allows (the probe and the profiler build theirs
    from the same two settings)."""
    default = LoopSettings(width_invariant="on")
    cache = Scheduler(tiny_target, default).cache
    assert cache.tiles(1) and not cache.tiles(2)
    every = Scheduler(tiny_target, LoopSettings(width_invariant="on", tile_max_rows=None)).cache
    assert every.tiles(64)
    four = Scheduler(tiny_target, LoopSettings(width_invariant="on", tile_max_rows=4)).cache
    assert four.tiles(4) and not four.tiles(5)
    assert not Scheduler(tiny_target, LoopSettings()).cache.tiles(1)  # float32: natural widths


def test_a_speculative_loop_that_would_verify_past_the_tile_is_refused(tiny_target):
    settings = LoopSettings(width_invariant="on", tile_width=5)
    assert Scheduler(tiny_target, settings).tile == 5  # a plain loop takes any tile
    with pytest.raises(RequestError, match="tile_width"):
        Scheduler(tiny_target, settings, [lookup()], k=5)
    with pytest.raises(RequestError, match="k_max 8 needs passes of 9 positions"):
        Scheduler(tiny_target, settings, [lookup()], k="auto", k_max=8)
    assert Scheduler(tiny_target, settings, [lookup()], k=4).tile == 5
    lookahead = LookaheadDrafter(window=4, ngram=3, guesses=4)
    with pytest.raises(RequestError, match="drafter lookahead needs passes of 17 positions; .* are 9 wide"):
        Scheduler(tiny_target, LoopSettings(width_invariant="on"), [lookahead], k=2)
    assert Scheduler(tiny_target, LoopSettings(width_invariant="on", tile_width=17), [lookahead], k=2).tile == 17
