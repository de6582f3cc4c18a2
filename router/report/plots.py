"""The report's plots, as PNGs beside report.html. Drawn with matplotlib's object API on the Agg
canvas (no display, no pyplot state shared between callers), and every plotted value is read from
the `Report`: a plot shows what report.json says, nothing recomputed from elsewhere."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from .data import LoadRow, Plot, Report

DPI = 110
# A fixed colour per backend, so every plot reads the same way; categories take matplotlib's cycle.
MODE_COLOURS = {"auto": "#1b7837", "speculative": "#2166ac", "plain": "#d6604d", "quantized": "#8073ac"}
INELIGIBLE = "#bdbdbd"
FALLBACK = ("#35978f", "#bf812d", "#762a83", "#4d4d4d", "#e08214")

# What a drawer gives back: the figure, its title and its caption; None when there is nothing to draw.
Drawn = tuple[Figure, str, str] | None


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _mode_colour(mode: str, modes: Sequence[str]) -> str:
    if mode in MODE_COLOURS:
        return MODE_COLOURS[mode]
    others = [m for m in modes if m not in MODE_COLOURS]
    return FALLBACK[others.index(mode) % len(FALLBACK)] if mode in others else FALLBACK[0]


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def _log2_batches(ax, ticks: Sequence[float]) -> None:
    """Concurrency doubles from level to level: a log2 axis spaces the levels evenly."""
    ticks = sorted({t for t in ticks if t and t > 0})
    if len(ticks) < 2:
        return
    if len(ticks) > 12:  # a dense sweep: label the doublings only, or the labels run together
        ticks = [t for t in ticks if math.log2(t).is_integer()] or ticks[:: len(ticks) // 8]
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()


def _heatmap(report: Report) -> Drawn:
    hm = report.heatmap
    z = np.asarray(hm.speedup, dtype=float)
    if z.size == 0 or z.shape != (len(hm.alphas), len(hm.ks)):
        return None
    fig = _figure(8.4, 5.8)
    ax = fig.add_subplot()
    lo, hi = float(np.nanmin(z)), float(np.nanmax(z))
    # Centred at 1.0 so colour says faster (blue) or slower (red) than plain decoding at a glance.
    # A side with no values gets the other side's span, so shades keep their meaning, and the
    # colour bar shows only the range the grid holds.
    span = max(hi - 1.0, 1.0 - lo, 1e-3)
    norm = TwoSlopeNorm(vcenter=1.0, vmin=lo if lo < 1.0 else 1.0 - span, vmax=hi if hi > 1.0 else 1.0 + span)
    mesh = ax.pcolormesh(hm.ks, hm.alphas, z, cmap="RdBu", norm=norm, shading="nearest")
    if len(hm.ks) > 1 and len(hm.alphas) > 1 and lo < 1.0 < hi:
        contour = ax.contour(hm.ks, hm.alphas, z, levels=[1.0], colors="black", linewidths=1.6)
        ax.clabel(contour, fmt={1.0: "1.0×"}, fontsize=9)
    # The two halves of the scale differ in length: tick each half on its own.
    ticks = [*(np.linspace(lo, 1.0, 3) if lo < 1.0 else []), 1.0, *(np.linspace(1.0, hi, 5) if hi > 1.0 else [])]
    bar = fig.colorbar(mesh, ax=ax, label="predicted speedup", ticks=sorted({round(float(t), 2) for t in ticks}))
    bar.ax.set_ylim(min(lo, 1.0), max(hi, 1.0))
    for p in hm.points:
        ax.scatter([p.k], [p.alpha], s=70, marker="o", facecolor="white", edgecolor="black", linewidth=1.5, zorder=3)
        label = f"{p.category} {p.measured:.2f}× measured" if p.measured is not None else p.category
        ax.annotate(
            label,
            (p.k, p.alpha),
            xytext=(7, 7),
            textcoords="offset points",
            fontsize=9,
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "0.5", "alpha": 0.85},
            zorder=4,
        )
    ax.set_xticks(hm.ks)
    ax.set_xlabel("draft length k (tokens proposed per step)")
    ax.set_ylabel("acceptance rate α")
    title = f"Predicted speedup over α × k at batch 1 (drafter {hm.drafter}, c = {hm.c:.3g})"
    ax.set_title(title, fontsize=11)
    caption = (
        f"Speedup of speculative decoding over plain decoding at batch 1 for drafter {hm.drafter} "
        f"(draft cost c = {hm.c:.3g}), every step proposing (ρ = 1). Blue is faster than plain, red slower; "
        "the black line is break-even (1.0×). Markers are the profiled categories at their α and the k "
        "acceptance was measured at."
    )
    return fig, title, caption


def _curve_label(report: Report, i: int) -> str:
    curve = report.curves[i]
    drafters = {c.drafter for c in report.curves}
    return curve.category if len(drafters) == 1 else f"{curve.category} ({curve.drafter})"


def _concurrency(report: Report) -> Drawn:
    fig = _figure(8.8, 5.4)
    ax = fig.add_subplot()
    handles: list = []
    batches: list[int] = []
    any_measured = any(c.measured for c in report.curves)
    any_be_measured = any(c.break_even_measured is not None for c in report.curves)
    for i, curve in enumerate(report.curves):
        colour = f"C{i % 10}"
        xs = [p.batch for p in curve.predicted]
        batches += xs + [p.batch for p in curve.measured]
        ax.plot(xs, [p.speedup for p in curve.predicted], "-", marker=".", color=colour, linewidth=2)
        if curve.measured:
            ax.plot(
                [p.batch for p in curve.measured],
                [p.speedup for p in curve.measured],
                linestyle="none",
                marker="o",
                markersize=7,
                markerfacecolor="white",
                markeredgewidth=1.8,
                color=colour,
            )
        if curve.break_even_predicted is not None:
            ax.axvline(curve.break_even_predicted, color=colour, linestyle=":", linewidth=1.6)
        if curve.break_even_measured is not None:
            ax.plot(
                [curve.break_even_measured], [1.0], marker="X", markersize=12, color=colour, markeredgecolor="black"
            )
        handles.append(Line2D([], [], color=colour, linewidth=2, label=_curve_label(report, i)))
    ax.axhline(1.0, color="0.25", linewidth=1)
    grey = "0.35"
    handles.append(Line2D([], [], color=grey, marker=".", label="predicted"))
    if any_measured:
        handles.append(Line2D([], [], color=grey, marker="o", markerfacecolor="white", ls="none", label="measured"))
    handles.append(Line2D([], [], color=grey, linestyle=":", label="break-even (predicted)"))
    if any_be_measured:
        handles.append(Line2D([], [], color=grey, marker="X", ls="none", markersize=10, label="break-even (measured)"))
    if report.curves:
        ax.legend(handles=handles, fontsize=9, loc="best")
    else:
        ax.text(0.5, 0.5, "no concurrency curves in the report", ha="center", va="center", transform=ax.transAxes)
    _log2_batches(ax, batches)
    ax.set_xlabel("concurrent sequences (batch)")
    ax.set_ylabel("speedup over plain decoding (best k)")
    ax.grid(alpha=0.3)
    title = "Speculation's speedup as concurrency grows"
    ax.set_title(title, fontsize=11)
    caption = (
        "Best speedup over plain decoding per category as the batch grows (log2 axis): lines predicted from α, c "
        "and v(b, k); open circles measured by bench model-fit. Below the 1.0 line speculation costs more than it "
        "saves; dotted verticals mark the predicted break-even, crosses the measured one."
    )
    return fig, title, caption


def _load_panels(rows: Sequence[LoadRow], x_of: Callable[[LoadRow], float], xlabel: str, log2: bool) -> Figure:
    fig = _figure(11.5, 7.8)
    axes = fig.subplots(2, 2)
    modes = list(dict.fromkeys(r.mode for r in rows))
    for mode in modes:
        cells = sorted((r for r in rows if r.mode == mode), key=x_of)
        xs = [x_of(r) for r in cells]
        style = {"color": _mode_colour(mode, modes), "marker": "o", "markersize": 4, "linewidth": 1.8}
        axes[0, 0].plot(xs, [r.tokens_per_s for r in cells], label=mode, **style)
        axes[0, 1].plot(xs, [_nan(r.ttft_ms.p50) for r in cells], **style)
        axes[0, 1].plot(xs, [_nan(r.ttft_ms.p99) for r in cells], linestyle="--", **style)
        axes[1, 0].plot(xs, [_nan(r.tpot_ms.p50) for r in cells], **style)
        axes[1, 1].plot(xs, [r.goodput_rps for r in cells], **style)
    panels = [
        (axes[0, 0], "output tokens/s", "Throughput"),
        (axes[0, 1], "TTFT (ms)", "Time to first token"),
        (axes[1, 0], "TPOT p50 (ms)", "Time per output token (p50)"),
        (axes[1, 1], "goodput (requests/s meeting the SLO)", "Goodput"),
    ]
    for ax, ylabel, name in panels:
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if log2:
            _log2_batches(ax, [x_of(r) for r in rows])
    axes[0, 0].legend(fontsize=9, title="mode", title_fontsize=9)
    axes[0, 1].legend(
        handles=[Line2D([], [], color="0.3", label="p50"), Line2D([], [], color="0.3", linestyle="--", label="p99")],
        fontsize=9,
    )
    return fig


def _load(report: Report, open_loop: bool) -> Drawn:
    """The bench load cells of one kind of loop: closed (x: clients) or open (x: request rate)."""
    rows = [r for r in report.load if (r.concurrency is None) == open_loop]
    if not rows:
        return None
    kind = "open" if open_loop else "closed"
    x_of = (lambda r: float(r.request_rate or 0.0)) if open_loop else (lambda r: float(r.concurrency or 0))
    axis = "offered load (requests/s, open loop)" if open_loop else "concurrent clients (closed loop)"
    fig = _load_panels(rows, x_of, axis, log2=not open_loop)
    title = f"Routed vs fixed backends under {kind}-loop load"
    fig.suptitle(title, fontsize=12)
    against = "the offered request rate" if open_loop else "the number of concurrent clients"
    caption = (
        f"bench load, {kind} loop: per mode (auto is the router) output tokens/s, TTFT p50 (solid) and p99 "
        f"(dashed), TPOT p50 and goodput, against {against}."
    )
    return fig, title, caption


def _validation(report: Report) -> Drawn:
    val = report.validation
    if not val.rows:
        return None
    fig = _figure(11.5, 4.9)
    left, right = fig.subplots(1, 2)
    modes = list(dict.fromkeys(r.mode for r in val.rows))
    top = max(max(r.measured_tokens_per_s, r.simulated_tokens_per_s) for r in val.rows) * 1.1
    line = np.linspace(0.0, top, 50)
    left.fill_between(
        line, line * (1 - val.tolerance), line * (1 + val.tolerance), color="0.88", label=f"±{val.tolerance:.0%}"
    )
    left.plot(line, line, color="black", linewidth=1, label="simulated = measured")
    for mode in modes:
        cells = [r for r in val.rows if r.mode == mode]
        left.scatter(
            [r.measured_tokens_per_s for r in cells],
            [r.simulated_tokens_per_s for r in cells],
            color=_mode_colour(mode, modes),
            label=mode,
            zorder=3,
        )
    left.set_xlim(0, top)
    left.set_ylim(0, top)
    left.set_xlabel("measured output tokens/s")
    left.set_ylabel("simulated output tokens/s")
    left.set_title("Each measured cell, simulated", fontsize=10)
    left.legend(fontsize=9)
    left.grid(alpha=0.3)
    _error_bars(right, report, modes)
    title = "The simulation against bench load"
    fig.suptitle(title, fontsize=12)
    mean = "" if val.mean_abs_tokens_error is None else f" Mean |error| {val.mean_abs_tokens_error:.1%}."
    caption = (
        f"Left: simulated vs measured output tokens/s per bench load cell, with the ±{val.tolerance:.0%} band the "
        f"simulation is trusted within. Right: the tokens/s error per level and mode.{mean}"
    )
    return fig, title, caption


def _error_bars(ax, report: Report, modes: Sequence[str]) -> None:
    val = report.validation
    levels = list(dict.fromkeys(r.level for r in val.rows))
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        errors = {r.level: r.tokens_error * 100 for r in val.rows if r.mode == mode}
        xs = [i + (j - (len(modes) - 1) / 2) * width for i, level in enumerate(levels) if level in errors]
        heights = [errors[level] for level in levels if level in errors]
        ax.bar(xs, heights, width=width, color=_mode_colour(mode, modes), label=mode)
    for bound in (val.tolerance * 100, -val.tolerance * 100):
        ax.axhline(bound, color="black", linestyle="--", linewidth=1)
    ax.axhline(0, color="0.3", linewidth=0.8)
    ax.set_xticks(range(len(levels)), levels, rotation=30, ha="right")
    ax.set_xlabel("level")
    ax.set_ylabel("tokens/s error (%), simulated vs measured")
    ax.set_title("Error per level (dashed: tolerance)", fontsize=10)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def _sizing(report: Report) -> Drawn:
    rows = report.sizing
    if not rows:
        return None
    fig = _figure(11.5, 5.0)
    left, right = fig.subplots(1, 2)
    names = [r.backend for r in rows]
    tallest = 1
    for i, r in enumerate(rows):
        height = r.replicas if r.replicas is not None else r.replicas_tried
        tallest = max(tallest, height)
        colour = MODE_COLOURS.get(r.backend, FALLBACK[0]) if r.eligible else INELIGIBLE
        # Not met within the most tried: a hatched bar at that size, labelled "> N".
        left.bar(i, height, color=colour, hatch="//" if r.replicas is None else None, edgecolor="black", linewidth=0.8)
        label = str(r.replicas) if r.replicas is not None else f"> {r.replicas_tried}"
        if not r.eligible:
            label += f"\n{r.ineligible_reason or 'not allowed'}"
        left.annotate(label, (i, height), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom")
    left.set_ylim(0, tallest * 1.3)
    left.set_xticks(range(len(rows)), names)
    left.set_ylabel("replicas to meet the SLO")
    left.set_title("Replicas needed", fontsize=10)
    left.yaxis.set_major_locator(MaxNLocator(integer=True))
    _cost_bars(right, report)
    title = "Sizing: replicas and cost per backend"
    fig.suptitle(title, fontsize=12)
    caption = (
        "Left: the fewest replicas meeting the SLO for the whole workload per backend (auto is the router); a hatched "
        "bar did not meet it within the most replicas tried, a grey one is not allowed by the policy. Right: "
        "$ per million output tokens at the operating point (idle time included) and saturated."
    )
    return fig, title, caption


def _cost_bars(ax, report: Report) -> None:
    rows = report.sizing
    width = 0.38
    for i, r in enumerate(rows):
        colour = MODE_COLOURS.get(r.backend, FALLBACK[0]) if r.eligible else INELIGIBLE
        series = [(-width / 2, r.usd_per_million_tokens, 1.0), (width / 2, r.usd_per_million_tokens_busy, 0.45)]
        for dx, value, alpha in series:
            if value is None or not np.isfinite(value):
                ax.annotate("n/a", (i + dx, 0), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
                continue
            ax.bar(i + dx, value, width=width, color=colour, alpha=alpha, edgecolor="black", linewidth=0.6)
            ax.annotate(
                f"${value:.2f}", (i + dx, value), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8
            )
    ax.set_xticks(range(len(rows)), [r.backend for r in rows])
    ax.set_ylabel("$ per million output tokens")
    ax.set_title("Cost per million output tokens", fontsize=10)
    ax.legend(
        handles=[
            Patch(facecolor="0.35", edgecolor="black", label="operating point (idle included)"),
            Patch(facecolor="0.35", alpha=0.45, edgecolor="black", label="saturated"),
        ],
        fontsize=9,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08),
        ncols=2,
    )
    ax.grid(alpha=0.3, axis="y")


def _what_if(report: Report) -> Drawn:
    rows = report.what_if
    if not rows:
        return None
    backends = list(dict.fromkeys(r.backend for r in rows))
    profiles = list(dict.fromkeys(r.profile for r in rows))
    series = list(dict.fromkeys((r.load_factor, r.profile) for r in rows))
    fig = _figure(min(4.0 * len(backends) + 1.5, 14.0), 5.2)
    axes = fig.subplots(1, len(backends), sharey=True, squeeze=False)[0]
    target = report.workload.slo.get("attainment")
    for ax, backend in zip(axes, backends, strict=True):
        for j, (factor, profile) in enumerate(series):
            cells = sorted(
                (r for r in rows if (r.backend, r.load_factor, r.profile) == (backend, factor, profile)),
                key=lambda r: r.replicas,
            )
            if not cells:
                continue
            colour = f"C{j % 10}"
            xs, ys = [r.replicas for r in cells], [r.attainment * 100 for r in cells]
            ax.plot(xs, ys, color=colour, linewidth=1.8)
            # Filled where the SLO is met, hollow where not.
            ax.scatter(xs, ys, color=colour, zorder=3, s=28)
            missed = [(x, y) for x, y, r in zip(xs, ys, cells, strict=True) if not r.meets_slo]
            if missed:
                ax.scatter(*zip(*missed, strict=True), facecolor="white", edgecolor=colour, zorder=4, s=28)
        if target is not None:
            ax.axhline(target * 100, color="black", linestyle="--", linewidth=1)
        ax.set_title(backend, fontsize=10)
        ax.set_xlabel("replicas")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("SLO attainment (% of requests)")
    # One legend for the figure: a series (a compared profile, say) may be on some panels only.
    handles = [
        Line2D([], [], color=f"C{j % 10}", marker="o", label=f"{f:g}× load" + (f", {p}" if len(profiles) > 1 else ""))
        for j, (f, p) in enumerate(series)
    ]
    if target is not None:
        handles.append(Line2D([], [], color="black", linestyle="--", label=f"target {target:.0%}"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), fontsize=9)
    title = "What-if: SLO attainment vs replicas"
    fig.suptitle(title, fontsize=12)
    caption = (
        "Simulated share of requests meeting the TTFT and TPOT SLO per backend as replicas are added, one line per "
        "load factor" + (" and profile" if len(profiles) > 1 else "") + "; hollow markers miss the SLO, the dashed "
        "line is the attainment target."
    )
    return fig, title, caption


# File name → drawer, in the order the page shows them.
DRAWERS: tuple[tuple[str, Callable[[Report], Drawn]], ...] = (
    ("heatmap.png", _heatmap),
    ("concurrency.png", _concurrency),
    ("load.png", partial(_load, open_loop=False)),
    ("load-open.png", partial(_load, open_loop=True)),
    ("validation.png", _validation),
    ("sizing.png", _sizing),
    ("what-if.png", _what_if),
)


def draw_plots(report: Report, out_dir: Path) -> list[Plot]:
    """Writes every plot the report has data for into out_dir and returns their entries, for
    report.plots. A plot with nothing to draw is removed if an earlier run left it there, so the
    folder never shows a stale one beside a report that does not list it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, draw in DRAWERS:
        path = out_dir / name
        drawn = draw(report)
        if drawn is None:
            path.unlink(missing_ok=True)
            continue
        fig, title, caption = drawn
        fig.savefig(path, dpi=DPI, facecolor="white")
        plots.append(Plot(name=name, title=title, caption=caption))
    return plots
