"""The speculative-decoding cost model: closed forms only, numpy only (no torch, no Ray).

With a per-token acceptance rate α and k drafted tokens, a verification step advances
E(α, k) = (1 − α^(k+1)) / (1 − α) tokens on average. Its cost, in units of one plain target
step at the same batch, is k·c (drafting, c per token) plus v(b, k) (a (k+1)-token target pass
over a 1-token pass). Speedup over plain decoding is E / (k·c + v).

Drafters such as prompt lookup propose nothing on some steps (no match). With a proposal rate ρ
and α measured on the steps that do propose, a step emits 1 + ρ·(E(α, k) − 1) tokens; a step
without a proposal runs a plain 1-token pass unless another sequence of the batch drafted (a batch
shares one pass width), so at batch b the pass is wide with probability q = 1 − (1 − ρ)^b and the
step costs k·c + q·v + (1 − q). ρ = 1 (a draft model always proposes) gives the textbook formula.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def tokens_per_step(alpha: float, k: int, proposal_rate: float = 1.0) -> float:
    """Mean tokens a step emits when only a share ρ of steps has a proposal: 1 + ρ·(E(α, k) − 1)."""
    rho = min(max(proposal_rate, 0.0), 1.0)
    return 1.0 + rho * (float(expected_tokens(alpha, k)) - 1.0)


def step_cost(k: int, c: float, v: float, proposal_rate: float = 1.0, batch: int = 1, v_plain: float = 1.0) -> float:
    """A step's cost in plain 1-token passes: drafting k·c, then the (k+1)-token pass v when some
    sequence of the batch drafted (probability 1 − (1 − ρ)^b), else a pass with no drafts, which
    costs v_plain = v(b, 0): the engine pads it to the cheapest width ≥ 1, which some matrix shapes
    make cheaper than a 1-token pass."""
    if k == 0:
        return v
    wide = 1.0 - (1.0 - min(max(proposal_rate, 0.0), 1.0)) ** batch
    return k * c + wide * v + (1.0 - wide) * v_plain


def speedup(
    alpha: float, k: int, c: float, v: float, proposal_rate: float = 1.0, batch: int = 1, v_plain: float = 1.0
) -> float:
    """Expected tokens per unit time relative to plain decoding; k = 0 is a plain step (1.0 when v = 1)."""
    cost = step_cost(k, c, v, proposal_rate, batch, v_plain)
    if cost <= 0:
        raise ValueError(f"step cost must be positive (k={k}, c={c}, v={v})")
    return tokens_per_step(alpha, k, proposal_rate) / cost


def best_k(alpha: float, c: float, verify_cost: Sequence[float], k_max: int | None = None) -> tuple[int, float]:
    """The k in 0..k_max with the highest speedup, and that speedup.

    `verify_cost[k]` is v(b, k): the measured cost of a (k+1)-token pass relative to a 1-token
    pass (so verify_cost[0] is 1). Ties go to the smaller k (less work for the same gain).
    """
    k_max = len(verify_cost) - 1 if k_max is None else min(k_max, len(verify_cost) - 1)
    gains = [speedup(alpha, k, c, verify_cost[k]) for k in range(k_max + 1)]
    k = int(np.argmax(gains))
    return k, gains[k]


def best_speculative_k(
    alpha: float,
    c: float,
    verify_cost: Sequence[float],
    k_min: int = 1,
    k_max: int | None = None,
    proposal_rate: float = 1.0,
    batch: int = 1,
) -> tuple[int, float]:
    """The k in k_min..k_max (k_min ≥ 1) with the highest speedup, even if it loses to plain decoding:
    what speculation would do at its best, for the policy to weigh against the alternatives."""
    k_max = len(verify_cost) - 1 if k_max is None else min(k_max, len(verify_cost) - 1)
    if not 1 <= k_min <= k_max:
        raise ValueError(f"need 1 <= k_min <= k_max (got k_min={k_min}, k_max={k_max})")
    v_plain = verify_cost[0]
    gains = [speedup(alpha, k, c, verify_cost[k], proposal_rate, batch, v_plain) for k in range(k_min, k_max + 1)]
    best = int(np.argmax(gains))
    return k_min + best, gains[best]


def effective_verify_costs(width_seconds: Sequence[float]) -> list[float]:
    """v(b, k) for k = 0..len-1 from one batch's pass times by width (`width_seconds[w-1]` for w
    tokens per sequence): a block of k + 1 tokens is padded to the cheapest width ≥ k + 1, as the
    engine does, so v never rises where a wider pass happens to run faster."""
    t = np.asarray(width_seconds, dtype=float)
    if t.ndim != 1 or not len(t) or np.any(t <= 0):
        raise ValueError("need positive pass times for widths 1..n")
    cheapest_from = np.minimum.accumulate(t[::-1])[::-1]
    return (cheapest_from / t[0]).tolist()


def per_token_seconds(
    step_s: float,
    alpha: float,
    k: int,
    c: float,
    v: float,
    proposal_rate: float = 1.0,
    batch: int = 1,
    v_plain: float = 1.0,
) -> float:
    """Expected seconds per output token of one sequence: a step costs step_s·(k·c + v) (see
    `step_cost`) and emits 1 + ρ·(E(α, k) − 1) tokens (k = 0, v = 1: a plain step, one token)."""
    return step_s * step_cost(k, c, v, proposal_rate, batch, v_plain) / tokens_per_step(alpha, k, proposal_rate)


def step_model(batches: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit t(b) = fixed + per_sequence·b to a decode-step curve: `fixed` is what a step costs no
    matter how many sequences share it (streaming the weights, launching kernels), `per_sequence`
    what each sequence adds (its FLOPs and its KV cache). Least squares on relative error, so the
    small batches count as much as the large ones; both parts are kept non-negative."""
    b, t = np.asarray(batches, dtype=float), np.asarray(seconds, dtype=float)
    if len(b) != len(t) or len(b) < 2:
        raise ValueError("need step times at two or more batch sizes")
    design = np.stack([np.ones_like(b), b], axis=1) / t[:, None]
    (fixed, per_sequence), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if per_sequence < 0:  # noise made the curve fall: nothing is per-sequence
        return float(np.mean(t)), 0.0
    if fixed < 0:  # every cost scales with the batch
        return 0.0, float(np.sum(b * t) / np.sum(b * b))
    return float(fixed), float(per_sequence)


def elasticity(batches: Sequence[float], seconds: Sequence[float], batch: float) -> float:
    """d log t / d log b of the fitted step model at `batch`: the share of a step that grows with
    the batch. ~0 while adding a sequence is nearly free (memory- or overhead-bound), → 1 once
    each sequence costs its full share (compute-bound)."""
    fixed, per_sequence = step_model(batches, seconds)
    grows = per_sequence * batch
    return grows / (fixed + grows) if fixed + grows > 0 else 1.0


def knee(batches: Sequence[float], seconds: Sequence[float], threshold: float = 0.5) -> float | None:
    """The concurrency from which the elasticity reaches `threshold`: where adding a sequence stops
    being nearly free. None when the curve has no per-sequence cost at all."""
    fixed, per_sequence = step_model(batches, seconds)
    if per_sequence <= 0:
        return None
    return max(1.0, threshold / (1 - threshold) * fixed / per_sequence)


def break_even_concurrency(speedup_at: Callable[[int], float], b_max: int, threshold: float = 1.0) -> int | None:
    """The smallest concurrency in 1..b_max at which speculation's best speedup drops below
    `threshold` (stops paying); None when it pays up to b_max."""
    for b in range(1, b_max + 1):
        if speedup_at(b) < threshold:
            return b
    return None
