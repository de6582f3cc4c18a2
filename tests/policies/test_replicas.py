from collections import Counter

from policies.replicas import ReplicaRouting, rank_replicas

REPLICAS = ["r0", "r1", "r2"]


def test_the_replica_holding_the_longest_prefix_comes_first_within_the_bound():
    loads = {"r0": 3, "r1": 1, "r2": 0}
    cached = {"r0": 640, "r1": 64}
    assert rank_replicas(REPLICAS, loads, cached, ReplicaRouting(max_imbalance=4)) == ["r0", "r1", "r2"]


def test_a_prefix_holder_busier_than_the_bound_yields_to_the_least_loaded():
    loads = {"r0": 5, "r1": 1, "r2": 0}
    cached = {"r0": 640}
    assert rank_replicas(REPLICAS, loads, cached, ReplicaRouting(max_imbalance=4)) == ["r2", "r1", "r0"]


def test_without_any_cached_prefix_or_with_affinity_off_the_least_loaded_wins():
    loads = {"r0": 2, "r1": 1, "r2": 3}
    assert rank_replicas(REPLICAS, loads, {}) == ["r1", "r0", "r2"]
    off = ReplicaRouting(prefix_affinity=False)
    assert rank_replicas(REPLICAS, loads, {"r2": 640}, off) == ["r1", "r0", "r2"]


def test_equal_replicas_keep_the_callers_order_and_missing_loads_count_as_zero():
    assert rank_replicas(["b", "a"], {}, {}) == ["b", "a"]
    assert rank_replicas([], {}, {}) == []


def test_a_hot_prefix_spreads_once_its_holder_runs_max_imbalance_ahead():
    """Every request shares one prompt and none finishes: affinity fills the first holder only up
    to the bound, then the others take turns (and, once warm, count as holders too)."""
    routing = ReplicaRouting(max_imbalance=2)
    loads: Counter[str] = Counter()
    holders: set[str] = set()
    for _ in range(30):
        chosen = rank_replicas(REPLICAS, loads, dict.fromkeys(holders, 600), routing)[0]
        loads[chosen] += 1
        holders.add(chosen)
        assert max(loads[r] for r in REPLICAS) - min(loads[r] for r in REPLICAS) <= routing.max_imbalance + 1
    assert sorted(loads.values()) == [10, 10, 10]
