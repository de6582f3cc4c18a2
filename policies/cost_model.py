"""The speculative-decoding cost model: closed forms only, numpy only (no torch, no Ray).

With a per-token acceptance rate α and k drafted tokens, a verification step advances
E(α, k) = (1 − α^(k+1)) / (1 − α) tokens on average. Its cost, in units of one plain target
step at the same batch, is k·c (drafting, c per token) plus v(b, k) (a (k+1)-token target pass
over a 1-token pass). Speedup over plain decoding is E / (k·c + v).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def expected_tokens(alpha: float | np.ndarray, k: int | np.ndarray) -> float | np.ndarray:
    """E(α, k): mean tokens a step emits (accepted drafts + the resampled or bonus token)."""
    alpha = np.clip(np.asarray(alpha, dtype=float), 0.0, 1.0)
    k = np.asarray(k, dtype=float)
    # At α = 1 the series 1 + α + … + α^k sums to k + 1; the closed form would divide by zero.
    near_one = np.isclose(alpha, 1.0)
    safe = np.where(near_one, 0.5, alpha)
    value = np.where(near_one, k + 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe))
    return float(value) if value.ndim == 0 else value


def speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Expected tokens per unit time relative to plain decoding; k = 0 is a plain step (1.0 when v = 1)."""
    cost = k * c + v
    if cost <= 0:
        raise ValueError(f"step cost must be positive (k={k}, c={c}, v={v})")
    return float(expected_tokens(alpha, k)) / cost


def best_k(alpha: float, c: float, verify_cost: Sequence[float], k_max: int | None = None) -> tuple[int, float]:
    """The k in 0..k_max with the highest speedup, and that speedup.

    `verify_cost[k]` is v(b, k): the measured cost of a (k+1)-token pass relative to a 1-token
    pass (so verify_cost[0] is 1). Ties go to the smaller k (less work for the same gain).
    """
    k_max = len(verify_cost) - 1 if k_max is None else min(k_max, len(verify_cost) - 1)
    gains = [speedup(alpha, k, c, verify_cost[k]) for k in range(k_max + 1)]
    k = int(np.argmax(gains))
    return k, gains[k]
