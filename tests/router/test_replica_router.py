"""The backends' request router over stand-in replicas (only their ids are read when ranking)."""

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from router.replica_registry import replica_counts
from router.replica_router import AffinityRouter

DEPLOYMENT = DeploymentID(name="PlainBackend", app_name="test")
PROMPT = list(range(100, 400))


def replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT))


def pending(n: int, ids: list[int] | None = PROMPT, salt: str | None = None) -> PendingRequest:
    request = {"prompt_ids": ids, "cache_salt": salt}
    return PendingRequest(
        args=[request, None, "continuous"],
        kwargs={},
        metadata=RequestMetadata(request_id=f"q{n}", internal_request_id=f"i{n}"),
    )


@pytest.fixture(autouse=True)
def event_loop_here():
    """Serve's base class binds to the current event loop when built."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    asyncio.set_event_loop(None)
    loop.close()


def router(**routing) -> AffinityRouter:
    r = AffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    r.initialize_state(prefix_blocks=64, **routing)
    return r


def send(r: AffinityRouter, replicas: list, request: PendingRequest) -> str:
    ranks = r.rank(replicas, request)
    assert all(len(rank) == 1 for rank in ranks) and len(ranks) == len(replicas)
    chosen = ranks[0][0].replica_id
    r.on_request_routed(request, chosen, None)
    return chosen.unique_id


def test_requests_sharing_a_prompt_follow_the_replica_that_holds_it_up_to_the_bound():
    r = router(max_imbalance=2)
    replicas = [replica("a"), replica("b")]
    first = send(r, replicas, pending(0))
    assert [send(r, replicas, pending(n)) for n in (1, 2)] == [first, first]  # 2 and then 3 ahead is the bound
    other = send(r, replicas, pending(3))
    assert other != first  # 3 ahead of an idle replica: over the bound, the least loaded takes it


def test_a_salted_prompt_or_one_without_ids_goes_to_the_least_loaded():
    r = router(max_imbalance=8)
    replicas = [replica("a"), replica("b")]
    first = send(r, replicas, pending(0))
    assert send(r, replicas, pending(1, salt="tenant-2")) != first  # another salt shares no block
    r.on_request_completed(ReplicaID(unique_id=first, deployment_id=DEPLOYMENT), "i0")
    assert r.loads[ReplicaID(unique_id=first, deployment_id=DEPLOYMENT)] == 0
    assert send(r, replicas, pending(2, ids=None)) == first  # nothing to match: the idle one


def test_completions_release_load_once_and_dead_replicas_lose_their_prefixes():
    r = router()
    a = replica("a")
    send(r, [a], pending(0))
    r.on_request_completed(a.replica_id, "i0")
    r.on_request_completed(a.replica_id, "i0")  # a second callback for one request changes nothing
    assert r.loads[a.replica_id] == 0
    assert r.prefixes.cached(PROMPT) == {str(a.replica_id): 288}
    r.on_replica_actor_died(a.replica_id)
    assert r.prefixes.cached(PROMPT) == {}


def test_the_router_registers_itself_for_replica_counts():
    r = router()
    r._replicas = {replica("a").replica_id: replica("a"), replica("b").replica_id: replica("b")}
    assert replica_counts()["PlainBackend"] == 2
