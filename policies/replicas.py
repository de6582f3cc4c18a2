"""Which replica of the chosen backend serves a request: the one expected to hold the longest
cached prefix of its prompt, unless that replica is busier than the least-loaded one by more than
`max_imbalance` requests; then (and when no replica holds any of it) the least loaded. The bound is
what keeps a hot prefix — one system prompt behind every request — from piling all traffic on the
replica that prefilled it first (Ray Serve's `PrefixCacheAffinityRouter` and llm-d's scorer weigh
the same two signals). Pure: the service's request router (`router.replica_router`) and the capacity
simulation (`policies.capacity`) rank replicas with this one rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field


class ReplicaRouting(BaseModel):
    """How requests spread over the replicas of one backend (the service's `replica_routing`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix_affinity: bool = Field(
        True, description="send a request to the replica expected to hold the longest cached prefix of its prompt"
    )
    max_imbalance: int = Field(
        4,
        ge=0,
        description="most requests more than the least-loaded replica that a prefix-holding replica may have and "
        "still be preferred (0: always the least loaded, prefix only breaking ties)",
    )


DEFAULT_ROUTING = ReplicaRouting()


def rank_replicas(
    replicas: Sequence[str],
    loads: Mapping[str, int],
    cached: Mapping[str, int],
    routing: ReplicaRouting = DEFAULT_ROUTING,
) -> list[str]:
    """`replicas` best first: within `max_imbalance` of the least load, the most cached prompt
    tokens (then the lighter load) first; the rest by load. Ties keep the given order, so a caller
    that shuffles `replicas` spreads equal ones. `loads`/`cached` may omit a replica (0)."""
    if not replicas:
        return []
    least = min(loads.get(r, 0) for r in replicas)
    bound = least + routing.max_imbalance

    def order(r: str) -> tuple[bool, int, int]:
        load = loads.get(r, 0)
        hit = cached.get(r, 0) if routing.prefix_affinity and load <= bound else 0
        return (load > bound, -hit, load)

    return sorted(replicas, key=order)
