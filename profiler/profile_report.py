"""The profile as a capacity-planning report: cost curves, where decode turns compute-bound, what
each drafter costs, acceptance per category, and how well α can be predicted."""

from __future__ import annotations

from policies.cost_model import knee, step_model
from policies.estimates import ProfileCosts
from policies.profile import Profile, QuantizedProfile

COMPUTE_BOUND = 0.5  # elasticity at which the report calls a batch compute-bound (the policy default)


def render_profile(profile: Profile, threshold: float = COMPUTE_BOUND) -> str:
    m = profile.model
    lines = [
        f"specroute profile — {m.name} ({m.served}, {m.device}, {m.threads} threads) on {profile.machine.get('cpu')}, "
        f"measured {profile.created:%Y-%m-%d %H:%M} UTC",
        f"acceptance: {profile.acceptance_source}",
        *_served_quality(profile),
        "",
        *_target_table(profile),
        *_context_table(profile),
        "",
        *_scaling(profile, threshold),
        "",
        "prefill (time to first token, batch 1): "
        + "  ".join(
            f"{n} tokens {s * 1e3:.0f} ms"
            for n, s in zip(profile.prefill.widths, profile.prefill.seconds[0], strict=True)
        ),
        "",
        *_drafters(profile),
        "",
        *_acceptance(profile),
    ]
    if profile.predictor:
        lines += ["", *_predictor(profile)]
    if profile.acceptance_maps:
        lines += ["", *_acceptance_maps(profile)]
    if profile.quantized is not None:
        lines += ["", *_quantized(profile)]
    return "\n".join(lines)


def _served_quality(profile: Profile) -> list[str]:
    """llama.cpp's weights against the float target (torch's target is the reference: no line)."""
    q = profile.model.quality
    if q is None:
        return []
    ppl = "" if q.perplexity_delta is None else f", perplexity {q.perplexity_delta:+.2%}"
    greedy = "" if q.greedy_match is None else f", identical first greedy tokens on {q.greedy_match:.0%} of prompts"
    return [
        f"{profile.model.served} against the float target: agreement {q.agreement:.1%} (teacher-forced){ppl}{greedy}"
    ]


def _quantized(profile: Profile) -> list[str]:
    lines: list[str] = []
    served = profile.quantized
    for q in [served, *profile.quantized_others]:
        assert q is not None
        role = "served" if q is served else "measured for comparison"
        ppl = "" if q.perplexity_delta is None else f", perplexity {q.perplexity_delta:+.2%}"
        greedy = "" if q.greedy_match is None else f", identical first greedy tokens on {q.greedy_match:.0%} of prompts"
        size = "" if q.weight_bytes is None else f"; weights {q.weight_bytes / 2**20:.0f} MiB"
        err = "" if q.max_weight_error is None else f", max weight error {q.max_weight_error:.3g}"
        lines += [
            f"quantized backend {q.method} ({role}): agreement with the target {q.agreement:.1%} (teacher-forced)"
            f"{ppl}{greedy}{size}{err}",
            f"  batch   {'quantized ms':>12}   target ms   speedup",
        ]
        for b, row in zip(q.curve.batches, q.curve.seconds, strict=True):
            target = profile.target.at(b, 1)
            lines.append(f"  {b:>5} {row[0] * 1e3:14.1f} {target * 1e3:11.1f} {target / row[0]:8.2f}×")
        lines += [*_stacked(q), ""]
    return lines[:-1]


def _stacked(q: QuantizedProfile) -> list[str]:
    """Speculation on the quantized backend: its verify passes and its drafters' α on its own tokens."""
    if not q.acceptance:
        return []
    tiled = f", passes tiled {q.tile_width} wide (exact)" if q.tile_width else ""
    ks = [w - 1 for w in q.curve.widths[1:]]
    v = ", ".join(f"v(1,{k}) {q.curve.at(1, k + 1) / q.curve.at(1, 1):.2f}" for k in ks)
    lines = [f"{q.method} stacked with speculation{tiled}: {v}"]
    for name in dict.fromkeys(a.drafter for a in q.acceptance):
        rows = [a for a in q.acceptance if a.drafter == name]
        per = ", ".join(f"{a.category} {a.alpha:.2f}" for a in rows)
        lines.append(f"{q.method} with {name}, α on its own tokens: {per}")
    return lines


def _target_table(profile: Profile) -> list[str]:
    curve, costs = profile.target, ProfileCosts(profile)
    widths = curve.widths
    context = profile.settings.get("context_tokens", "?")
    lines = [
        f"target pass t(b, n) in ms, n = new tokens per sequence (n = k + 1 verifies k drafts), "
        f"{context} tokens cached per sequence:"
    ]
    lines.append("  batch " + "".join(f"{w:>8}" for w in widths))
    lines += [
        f"  {b:>5} " + "".join(f"{s * 1e3:8.1f}" for s in row)
        for b, row in zip(curve.batches, curve.seconds, strict=True)
    ]
    lines.append("v(b, k) = cheapest pass of ≥ k + 1 tokens over a 1-token pass:")
    lines.append("  batch " + "".join(f"{'k=' + str(k):>8}" for k in range(1, len(widths))))
    lines += [f"  {b:>5} " + "".join(f"{v:8.2f}" for v in costs.verify_costs(b)[1:]) for b in curve.batches]
    return lines


CONTEXTS_SHOWN = (64, 512, 1024, 2048)


def _context_table(profile: Profile) -> list[str]:
    """How the decode step and v(b, widest) move with the cached context (the cost model's reading)."""
    context = profile.context
    if context is None:
        return []
    widest = profile.target.max_width
    measured = ", ".join(str(n) for n in context.contexts)
    lines = [
        f"by cached context (measured at {measured} tokens; each batch's line fitted in context): "
        f"1-token pass ms and v(b, {widest - 1})",
        "  batch " + "".join(f"{f'{n} tok':>16}" for n in CONTEXTS_SHOWN),
    ]
    for b in profile.target.batches:
        cells = []
        for n in CONTEXTS_SHOWN:
            costs = ProfileCosts(profile, n)
            cells.append(f"{costs.step_s(b) * 1e3:8.1f} {costs.verify_costs(b)[widest - 1]:6.2f} ")
        lines.append(f"  {b:>5} " + "".join(f"{c:>16}" for c in cells))
    return lines


def _scaling(profile: Profile, threshold: float) -> list[str]:
    curve, costs = profile.target, ProfileCosts(profile)
    steps = [curve.at(b, 1) for b in curve.batches]
    lines = [
        "decode step by concurrency (elasticity = d log t / d log b of the fit; 0: a sequence is free, 1: full share):"
    ]
    lines.append(f"  {'batch':>5} {'step ms':>8} {'ms/seq':>8} {'tok/s':>8} {'elasticity':>10}  regime")
    for b, s in zip(curve.batches, steps, strict=True):
        eps = costs.elasticity(b)
        regime = "compute-bound" if eps >= threshold else "memory/overhead-bound"
        lines.append(f"  {b:>5} {s * 1e3:8.1f} {s * 1e3 / b:8.2f} {b / s:8.1f} {eps:10.2f}  {regime}")
    fixed, per_sequence = step_model(curve.batches, steps)
    point = knee(curve.batches, steps, threshold)
    lines.append(
        f"fit: a step costs {fixed * 1e3:.1f} ms whatever the batch + {per_sequence * 1e3:.2f} ms per sequence"
    )
    if point is None:
        lines.append("no per-sequence cost measured: decode stays memory/overhead-bound at every batch")
    else:
        beyond = " (beyond the measured batches)" if point > curve.batches[-1] else ""
        lines.append(
            f"adding a sequence stops being nearly free from concurrency ≈ {point:.0f}{beyond} "
            f"(elasticity ≥ {threshold:g})"
        )
    return lines


def _drafters(profile: Profile) -> list[str]:
    costs = ProfileCosts(profile)
    batches = profile.target.batches
    lines = ["drafters: c = one draft step over one target step, by batch:"]
    lines.append(f"  {'drafter':40}" + "".join(f"{b:>7}" for b in batches))
    for d in profile.drafters:
        lines.append(f"  {d.name:40}" + "".join(f"{costs.draft_cost(d, b):7.3f}" for b in batches))
    calibrated = [d for d in profile.drafters if d.probed_seconds is not None]
    lines += [
        f"  ({d.name}: drafting in real speculative runs cost {d.calibration:.2f}× a bare forward pass of the "
        "draft model; the curve above includes that)"
        for d in calibrated
    ]
    return lines


def _acceptance(profile: Profile) -> list[str]:
    lines = [
        "acceptance (greedy, fixed k). ρ: share of steps with a proposal; α: accepted / judged tokens on those "
        "steps (the cost model's); rate: accepted / drafted (vLLM's); tok/step: tokens per step, proposal or not; "
        "acc.len: per step with a proposal; by position: share of steps accepting token j:"
    ]
    lines.append(
        f"  {'category':14} {'drafter':40} {'k':>2} {'ρ':>5} {'α':>5} {'rate':>5} {'tok/step':>8} {'acc.len':>7} "
        f"{'γ':>6}  by position"
    )
    for a in profile.acceptance:
        positions = " ".join(f"{p:.2f}" for p in a.accepted_per_position[:8])
        lines.append(
            f"  {a.category:14} {a.drafter:40} {a.k:>2} {a.proposal_rate:5.2f} {a.alpha:5.2f} {a.acceptance_rate:5.2f} "
            f"{a.tokens_per_step:8.2f} {a.mean_accepted_length:7.2f} {a.gamma:6.3f}  {positions}"
        )
    return lines


def _predictor(profile: Profile) -> list[str]:
    drafters = max(len({s.drafter for s in profile.samples}), 1)
    training = sum(s.prompt_set == "training" for s in profile.samples) // drafters
    lines = [
        f"α and ρ predictors (fitted on {len(profile.project_samples) // drafters} prompts of the profiled set and "
        f"{training} of the training set per drafter; the profile's α per category reads the profiled set only), "
        "cross-validated on held-out prompts (mean absolute error; baselines: the training folds' mean, and their "
        "mean for the prompt's category; model: what cross-validation chose):"
    ]
    lines.append(
        f"  {'drafter':40} {'predicts':>8} {'prompts':>7} {'folds':>5} {'+category':>9} {'text only':>9} "
        f"{'constant':>9} {'cat. mean':>9}  model"
    )
    for s in profile.predictor:
        category_mean = "—" if s.mae_category_mean is None else f"{s.mae_category_mean:.3f}"
        lines.append(
            f"  {s.drafter:40} {'α' if s.target == 'alpha' else 'ρ':>8} {s.samples:>7} {s.folds:>5} "
            f"{s.mae_with_category:9.3f} {s.mae_text_only:9.3f} {s.mae_constant:9.3f} {category_mean:>9}  "
            f"{s.model or '—'}"
        )
    return lines


def _acceptance_maps(profile: Profile) -> list[str]:
    """Each drafter's per-proposal acceptance map: what it reads, and its out-of-fold calibration."""
    lines = [
        "per-proposal acceptance maps (what auto k verifies by), scored out of fold with prompts held out: "
        "Brier score (lower is better; a constant at the folds' rate in brackets) and the reliability curve "
        "(mean predicted → accepted share, per tenth of the range):"
    ]
    for m in profile.acceptance_maps:
        weights = ", ".join(f"{f} {c:+.2f}" for f, c in zip(m.features, m.coef, strict=True))
        score = "not scored" if m.brier is None else f"Brier {m.brier:.3f} ({m.brier_constant:.3f})"
        lines.append(f"  {m.drafter}: {m.samples} positions from {m.prompts} prompts, {score}")
        lines.append(f"    logit = {m.intercept:+.2f} + {weights}")
        if m.reliability:
            lines.append(
                "    reliability: "
                + "  ".join(f"{b.mean_predicted:.2f}→{b.accepted_share:.2f} (n={b.count})" for b in m.reliability)
            )
    return lines
