"""Ray Serve's request router for the backend deployments: which replica of a backend serves a
request, by `policies.replicas.rank_replicas` — prefix affinity within a load bound, else the least
loaded. It runs inside the Router replica's deployment handles (one instance per backend), so its
view is that Router's: the requests it has in flight on each replica, counted exactly from Serve's
routed/completed callbacks, and the prompt blocks it sent each replica (`PrefixIndex`, keyed by
replica). The request's `prompt_ids` and `cache_salt` (set by `RouterCore.prepare`) give the blocks.

Each instance registers itself (`router.replica_registry`), whose `replica_counts()` tells the
policy how many replicas each backend's handle routes over (its per-replica batch,
`LoadSnapshot.replicas`).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from policies.replicas import ReplicaRouting, rank_replicas

from .prefix_index import PrefixIndex
from .replica_registry import register


class AffinityRouter(RequestRouter):
    """Prefix affinity then least load over one backend's replicas (see the module docstring)."""

    def initialize_state(self, prefix_blocks: int = 0, **routing: Any) -> None:
        """`prefix_blocks`: what one replica's KV pool holds, in blocks (0: the backend caches no
        prefix, so only load counts); `routing`: `ReplicaRouting`'s fields."""
        self.routing = ReplicaRouting.model_validate(routing)
        self.prefixes = PrefixIndex(prefix_blocks, None)
        self.requests: dict[str, ReplicaID] = {}  # internal request id → where it runs
        register(self._deployment_id.name, self)

    @property
    def loads(self) -> Counter[ReplicaID]:
        """Requests this router has in flight on each replica."""
        return Counter(self.requests.values())

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        return self.rank(candidate_replicas, pending_request)

    def rank(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """The candidates best first, one per rank: Serve tries the next if one refuses."""
        replicas = list(candidate_replicas)
        random.shuffle(replicas)  # equals spread; rank_replicas keeps the given order among them
        by_id = {str(r.replica_id): r for r in replicas}
        running = self.loads
        loads = {str(r.replica_id): running[r.replica_id] for r in replicas}
        cached = self.prefixes.cached(*_prompt(pending_request)) if pending_request is not None else {}
        ranked = rank_replicas(list(by_id), loads, cached, self.routing)
        return [[by_id[r]] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.requests[pending_request.metadata.internal_request_id] = replica_id
        ids, salt = _prompt(pending_request)
        if ids:
            self.prefixes.sent(str(replica_id), ids, salt)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.requests.pop(internal_request_id, None)  # Serve may report one request twice: counted once

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {str(r.replica_id) for r in replicas}
        for gone in [h for h in self.prefixes.blocks if h not in live]:
            self.prefixes.forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.forget(str(replica_id))  # a new replica starts with an empty cache


def _prompt(pending_request: PendingRequest) -> tuple[list[int], str | None]:
    """The prompt ids and cache salt of a backend call `generate(request, …)` (none for other calls)."""
    request = pending_request.args[0] if pending_request.args else None
    if not isinstance(request, dict):
        return [], None
    return request.get("prompt_ids") or [], request.get("cache_salt")
