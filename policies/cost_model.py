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

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def expected_tokens(alpha: float | np.ndarray, k: int | np.ndarray) -> float | np.ndarray:
    """E(α, k): mean tokens a step emits (accepted drafts + the resampled or bonus token)."""
    if isinstance(alpha, float | int) and isinstance(k, int | float):
        # Scalars are the policy's hot path (every decision scores each k): plain floats, same
        # formula and the same α ≈ 1 tolerance as np.isclose's defaults below.
        a = min(max(float(alpha), 0.0), 1.0)
        return float(k) + 1.0 if abs(a - 1.0) <= 1e-8 + 1e-5 else (1.0 - a ** (float(k) + 1.0)) / (1.0 - a)
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


def run_speedup(alpha: float, ks: Sequence[int], pass_costs: Sequence[float], draft_cost: float) -> float:
    """The model's speedup over a run of steps as they ran: step s verified ks[s] drafted tokens
    (0: none, it emits one token) in a pass costing pass_costs[s] plain passes, and drafting cost
    draft_cost plain passes in all: Σ E(α, k_s) / (draft_cost + Σ v_s). Which steps drafted and how
    wide their passes ran are facts of the run; what each step yields is the model's."""
    if len(ks) != len(pass_costs) or not ks:
        raise ValueError(f"need one pass cost per step (got {len(ks)} steps, {len(pass_costs)} costs)")
    cost = draft_cost + float(sum(pass_costs))
    if cost <= 0:
        raise ValueError("a run's cost must be positive")
    return float(sum(expected_tokens(alpha, int(k)) for k in ks)) / cost


@dataclass(frozen=True)
class RowOutlook:
    """One running sequence as the step planner sees it."""

    drafter: str | None  # None: the sequence never drafts
    alpha: float  # per-token acceptance estimate (used where `acceptance` does not reach)
    proposal_rate: float  # share of the steps that ask in which the drafter proposes anything
    k_cap: int  # the most tokens it may draft now (tokens left, context, the drafter's limit)
    # Predicted acceptance of each drafted position given every earlier one was accepted: set once
    # a proposal exists (then it is certain to exist: ρ = 1), empty before drafting.
    acceptance: tuple[float, ...] = ()

    def gain(self, k: int) -> float:
        """Extra tokens expected from drafting k (beyond the step's own one): Σ_{i≤k} Π_{m≤i} a_m
        over the predicted positions, α for each position past them, times ρ without a proposal."""
        k = min(k, self.k_cap)
        if not self.acceptance:
            return tokens_per_step(self.alpha, k, self.proposal_rate) - 1.0
        total, survive = 0.0, 1.0
        for i in range(k):
            a = self.acceptance[i] if i < len(self.acceptance) else self.alpha
            survive *= min(max(a, 0.0), 1.0)
            total += survive
        return total

    @property
    def silent(self) -> float:
        """The chance that it proposes nothing at all."""
        return 0.0 if self.acceptance else 1.0 - min(max(self.proposal_rate, 0.0), 1.0)


def plan_step(
    rows: Sequence[RowOutlook],
    pass_seconds: Sequence[float],
    draft_seconds: Mapping[str, float],
    k_max: int,
    catch_up_seconds: Mapping[str, float] | None = None,
    drafted: Mapping[str, int] | None = None,
    spent_seconds: float = 0.0,
) -> list[int]:
    """How many tokens each sequence of a batch drafts — or, once drafted, verifies — this step:
    the choice that maximises the whole step's expected tokens per second.

    One target pass serves the batch, so its width is shared: `pass_seconds[w - 1]` is a pass of
    w tokens per sequence at this batch (padded to the cheapest width ≥ w). A drafter drafts its
    sequences together, `draft_seconds[d]` per sequential draft step, after `catch_up_seconds[d]`
    reading the context its sequences gained since it last drafted for them (a sequence that just
    joined, or skipped drafting). So each drafter gets one k
    (its sequences draft min(k, their cap); a drafter at k = 0 leaves its sequences as plain
    rows of the same pass), every combination is scored, and ties go to less drafting. A step
    emits Σ 1 + gain(k) tokens and costs the drafting plus a wide pass when some sequence
    proposed (probability 1 − Π(1 − ρ)), else a narrow one.

    The same choice serves every moment of a step: before drafting (α and ρ only); while drafting
    (`drafted[d]` steps already drawn cost nothing more, the rows carry their predicted
    acceptance so far); and after it, choosing how much of each proposal to verify (every step
    drawn, caps at the proposals' lengths). `spent_seconds`, drafting this step already took,
    counts in every option's time, k = 0 included."""
    t = effective_seconds(pass_seconds)
    k_top = min(k_max, len(t) - 1)
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        if row.drafter is not None and row.k_cap > 0:
            groups.setdefault(row.drafter, []).append(i)
    names = list(groups)
    tables = [_group_table([rows[i] for i in groups[d]], k_top) for d in names]
    done = drafted or {}
    best, best_rate = (0,) * len(names), len(rows) / (spent_seconds + t[0])
    for ks in itertools.product(*(range(len(gain)) for gain, _, _ in tables)):
        tokens, none_propose, width, drafting = float(len(rows)), 1.0, 1, spent_seconds
        for d, k, (gain, silent, cap) in zip(names, ks, tables, strict=True):
            if k:
                tokens += gain[k]
                none_propose *= silent
                width = max(width, 1 + min(k, cap))
                more = max(k - done.get(d, 0), 0)
                drafting += more * draft_seconds.get(d, 0.0) + ((catch_up_seconds or {}).get(d, 0.0) if more else 0.0)
        seconds = drafting + (1 - none_propose) * t[width - 1] + none_propose * t[0]
        if tokens / seconds > best_rate * (1 + 1e-9):
            best, best_rate = ks, tokens / seconds
    chosen = dict(zip(names, best, strict=True))
    return [min(chosen.get(row.drafter, 0), row.k_cap) if row.drafter else 0 for row in rows]


def _group_table(rows: Sequence[RowOutlook], k_top: int) -> tuple[list[float], float, int]:
    """For a drafter's sequences: the extra tokens they are expected to add at each k in
    0..(their largest cap), the chance that none of them proposes anything, and that cap."""
    cap = min(max(r.k_cap for r in rows), k_top)
    gain = [sum(r.gain(k) for r in rows) for k in range(cap + 1)]
    silent = float(np.prod([r.silent for r in rows]))
    return gain, silent, cap


def effective_seconds(width_seconds: Sequence[float]) -> list[float]:
    """Pass seconds by width when every block is padded to the cheapest width ≥ its own."""
    t = np.asarray(width_seconds, dtype=float)
    if t.ndim != 1 or not len(t) or np.any(t <= 0):
        raise ValueError("need positive pass times for widths 1..n")
    return np.minimum.accumulate(t[::-1])[::-1].tolist()


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
    return [s / width_seconds[0] for s in effective_seconds(width_seconds)]


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
