"""The report as Markdown and as one self-contained HTML page. Both are laid out from the same list
of blocks, so they show the same sections with the same numbers, and both are a pure function of
report.json (the HTML also embeds the PNGs beside it). Every number printed is a field of the
Report, only formatted: MiB from bytes, percent from fractions, and the equations' text from the
Equation fields."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .data import Equation, InputFile, Plot, Report, SizingRow
from .plots import draw_plots

DASH = "—"
HEADINGS = (
    "Machine",
    "Inputs",
    "Workload",
    "1. The trade-off on this hardware",
    "2. Speedup over acceptance and draft length",
    "3. Speedup vs concurrency",
    "4. Routed vs fixed backends",
    "5. Sizing",
    "6. What-if",
    "7. Recommendation",
    "Notes",
)
# Where in the page each plot goes; a plot named otherwise goes under "Other plots" at the end.
PLOT_SLOTS = {
    "heatmap.png": "heatmap",
    "concurrency.png": "concurrency",
    "load.png": "load",
    "load-open.png": "load",
    "sizing.png": "sizing",
    "validation.png": "validation",
    "what-if.png": "what-if",
}


# --- blocks: what both renderers lay out -------------------------------------------------------


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str
    strong: bool = False
    callout: bool = False


@dataclass(frozen=True)
class Table:
    headers: Sequence[str]
    rows: Sequence[Sequence[str]]


@dataclass(frozen=True)
class Bullets:
    items: Sequence[str]


@dataclass(frozen=True)
class Formula:
    lines: Sequence[str]


@dataclass(frozen=True)
class Image:
    plot: Plot


Block = Heading | Para | Table | Bullets | Formula | Image


# --- formatting: the only transformations numbers go through ----------------------------------


def _f(x: float | None, digits: int = 2) -> str:
    return DASH if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _sig(x: float | None, digits: int = 3) -> str:
    """Fixed-point with `digits` significant digits (at least 2 decimals): draft costs run from
    0.5 down to 0.0004, and scientific notation would read badly in a formula."""
    if x is None or not math.isfinite(x):
        return DASH
    if x == 0:
        return "0.00"
    decimals = min(max(2, digits - 1 - math.floor(math.log10(abs(x)))), 8)
    return f"{x:.{decimals}f}"


def _times(x: float | None) -> str:
    return DASH if x is None or not math.isfinite(x) else f"{x:.2f}×"


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return DASH
    return f"{x * 100:+.1f}%" if signed else f"{x * 100:.1f}%"


def _mib(n: int | None) -> str:
    return DASH if n is None else f"{n / 2**20:.1f}"


def _usd(x: float | None) -> str:
    return DASH if x is None or not math.isfinite(x) else f"${x:.2f}" if abs(x) >= 0.1 else f"${_sig(x)}"


def _general(x: float | int | None) -> str:
    """A number as given (SLO values, load factors): 500.0 reads as 500, 0.25 as 0.25."""
    return DASH if x is None else f"{x:g}"


def _pcts(p) -> str:
    return f"{_f(p.p50, 1)} / {_f(p.p90, 1)} / {_f(p.p99, 1)}"


def _shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{name} {_pct(share)}" for name, share in shares.items()) or DASH


def _ratios(ratios: dict[str, float | None]) -> str:
    return ", ".join(f"{name} {_times(x)}" for name, x in ratios.items()) or DASH


def _yes(x: bool | None) -> str:
    return DASH if x is None else "yes" if x else "no"


# --- sections ----------------------------------------------------------------------------------


def _missing(f: InputFile) -> str | None:
    return f.status.removeprefix("missing:").strip() if f.status.startswith("missing") else None


def _header(report: Report) -> list[Block]:
    m = report.machine
    out: list[Block] = [Heading(1, report.title), Para(f"Created {report.created} · report format {report.version}")]
    out += [
        Heading(2, "Machine"),
        Table(
            ["CPU", "cores", "threads", "device", "model", "dtype", "parameters", "weights (MiB)"],
            [
                [
                    m.cpu,
                    _general(m.cores),
                    str(m.threads),
                    m.device,
                    m.model,
                    m.dtype,
                    str(m.parameters),
                    _mib(m.weight_bytes),
                ]
            ],
        ),
        Heading(2, "Inputs"),
    ]
    missing = [(f.name, how) for f in report.inputs if (how := _missing(f)) is not None]
    if missing:
        out.append(Para("Missing inputs: the sections that need them say so.", strong=True, callout=True))
        out.append(Bullets([f"{name}: {how}" for name, how in missing]))
    rows = [
        [f.name, f.path or DASH, f.created or DASH, f"MISSING: {how}" if (how := _missing(f)) else f.status]
        for f in report.inputs
    ]
    out.append(Table(["input", "path", "created", "status"], rows))
    return out + _workload(report)


def _workload(report: Report) -> list[Block]:
    w = report.workload
    slo = ", ".join(f"{k} {_pct(v) if 'attainment' in k else _general(v)}" for k, v in w.slo.items()) or DASH
    rows = [
        ["workload", f"{w.name} ({w.source})"],
        ["mix", _shares(w.mix)],
        ["prompts rated one by one", _general(w.prompts_rated)],
        ["mean input / output tokens", f"{_f(w.input_tokens_mean, 1)} / {_f(w.output_tokens_mean, 1)}"],
        ["arrival rate (requests/s)", _general(w.arrival_rate)],
        ["concurrency levels", ", ".join(str(c) for c in w.concurrency) if w.concurrency else DASH],
        ["SLO", slo],
        ["simulated requests", str(w.simulated_requests)],
    ]
    return [Heading(2, "Workload"), Table(["", "value"], rows)]


def _equation(eq: Equation) -> Formula:
    """The seed's formulas with the Equation's numbers. With ρ < 1 a step may have nothing to
    verify, so the tokens per step and the step cost are printed as the fields give them."""
    a, k = _f(eq.alpha), eq.k
    lines = [
        f"{eq.category} · {eq.drafter}: batch 1, best k = {k}, α = {a}, ρ = {_f(eq.proposal_rate)}, "
        f"c = {_sig(eq.c)}, v = {_f(eq.v)}",
        f"E = (1 − α^(k+1)) / (1 − α) = (1 − {a}^{k + 1}) / (1 − {a}) = {_f(eq.expected_tokens)}",
    ]
    if eq.proposal_rate >= 1.0:
        tokens, c, v = _f(eq.tokens_per_step), _sig(eq.c), _f(eq.v)
        lines.append(f"speedup = E / (k·c + v) = {tokens} / ({k}·{c} + {v}) = {_times(eq.speedup)}")
        return Formula(lines)
    rho, e = _f(eq.proposal_rate), _f(eq.expected_tokens)
    lines += [
        f"E' = 1 + ρ·(E − 1) = 1 + {rho}·({e} − 1) = {_f(eq.tokens_per_step)} tokens per step",
        f"step cost = k·c + ρ·v + (1 − ρ)·v(1, 0) = {_f(eq.step_cost)} (a step with no proposal verifies nothing)",
        f"speedup = E' / step cost = {_f(eq.tokens_per_step)} / {_f(eq.step_cost)} = {_times(eq.speedup)}",
    ]
    return Formula(lines)


def _tradeoff(report: Report) -> list[Block]:
    acc = [
        [a.category, a.drafter, str(a.k), _f(a.alpha), _f(a.proposal_rate), _f(a.mean_accepted_length), str(a.prompts)]
        for a in report.acceptance
    ]
    costs = [[d.drafter, d.kind, _f(d.step_ms, 2), _sig(d.c), _mib(d.weight_bytes)] for d in report.draft_costs]
    vt = report.verify
    verify = [
        [str(b), _f(vt.step_ms[i] if i < len(vt.step_ms) else None, 1), *(_f(x) for x in vt.v[i])]
        for i, b in enumerate(vt.batches)
    ]
    out: list[Block] = [
        Heading(2, HEADINGS[3]),
        Para(
            "Speculation pays when the tokens a step yields outweigh what the step costs: α is the share of "
            "drafted tokens the target accepts, ρ the share of steps with a proposal, c one draft step over one "
            "target step, and v(b, k) a (k + 1)-token target pass over a 1-token pass at batch b."
        ),
        Heading(3, "Acceptance per category and drafter"),
        Table(["category", "drafter", "measured at k", "α", "ρ", "mean accepted length", "prompts"], acc),
        Heading(3, "Draft costs"),
        Table(["drafter", "kind", "draft step at batch 1 (ms)", "c", "weights (MiB)"], costs),
        Heading(3, "Verify costs v(b, k)"),
        Table(["batch", "1-token pass (ms)", *(f"k={k}" for k in vt.ks)], verify),
        Heading(3, "The equations with this machine's numbers"),
    ]
    return out + ([_equation(eq) for eq in report.equations] or [Para("No equations in the report.")])


def _heatmap(report: Report) -> list[Block]:
    hm = report.heatmap
    rows = [
        [
            p.category,
            _f(p.alpha),
            _f(p.proposal_rate),
            str(p.k),
            _times(p.predicted),
            _times(p.measured) if p.measured is not None else "not given",
        ]
        for p in hm.points
    ]
    return [
        Heading(2, HEADINGS[4]),
        Para(
            f"Predicted speedup at batch 1 for drafter {hm.drafter} (c = {_sig(hm.c)}): the map assumes every step "
            "proposes (ρ = 1); each category's own prediction below counts its ρ, the share of steps the drafter "
            "finds something to propose."
        ),
        *_images(report, "heatmap"),
        Table(["category", "α", "ρ", "k (as profiled)", "predicted (with its ρ)", "measured (bench spec)"], rows),
    ]


def _concurrency(report: Report) -> list[Block]:
    curves = report.curves
    be = [
        [
            c.category,
            c.drafter,
            _general(c.break_even_predicted) if c.break_even_predicted is not None else "none in the range",
            _measured_break_even(c),
            _general(c.measured_batches_max),
        ]
        for c in curves
    ]
    batches = list(dict.fromkeys(p.batch for c in curves for p in [*c.predicted, *c.measured]))
    headers, columns = ["batch"], []
    for c in curves:
        headers.append(f"{c.category} predicted")
        columns.append({p.batch: p for p in c.predicted})
        if c.measured:
            headers.append(f"{c.category} measured")
            columns.append({p.batch: p for p in c.measured})
    table = [
        [str(b), *(f"{_times(col[b].speedup)} (k={col[b].k})" if b in col else DASH for col in columns)]
        for b in sorted(batches)
    ]
    return [
        Heading(2, HEADINGS[5]),
        *_images(report, "concurrency"),
        Heading(3, "Break-even"),
        Table(
            [
                "category",
                "drafter",
                "predicted break-even batch",
                "measured break-even batch",
                "largest measured batch",
            ],
            be,
        ),
        Heading(3, "Best speedup per batch"),
        Table(headers, table),
    ]


def _measured_break_even(c) -> str:
    if not c.measured:
        return "not measured"
    return _general(c.break_even_measured) if c.break_even_measured is not None else "none measured"


def _how_to_get(report: Report, name: str) -> list[Block]:
    return [Para(f"To get it: {how}", callout=True) for f in report.inputs if f.name == name and (how := _missing(f))]


def _load(report: Report) -> list[Block]:
    out: list[Block] = [Heading(2, HEADINGS[6])]
    if not report.load:
        return (
            out
            + [Para("No bench load results were given, so routed vs fixed serving is not measured here.")]
            + (_how_to_get(report, "bench load"))
        )
    rows = [
        [
            r.level,
            _general(r.concurrency) if r.concurrency is not None else f"{_general(r.request_rate)} req/s",
            r.mode,
            _pcts(r.ttft_ms),
            _pcts(r.tpot_ms),
            _pcts(r.e2e_ms),
            _f(r.tokens_per_s, 1),
            _f(r.goodput_rps, 3),
            f"{r.errors} / {r.requests}",
            _shares(r.served_by),
        ]
        for r in report.load
    ]
    headers = [
        "level",
        "clients or rate",
        "mode",
        "TTFT p50 / p90 / p99 (ms)",
        "TPOT p50 / p90 / p99 (ms)",
        "e2e p50 / p90 / p99 (ms)",
        "tokens/s",
        "goodput (req/s)",
        "errors / requests",
        "served by",
    ]
    out += [Table(headers, rows), *_images(report, "load")]
    if report.load_comparisons:
        comp = [
            [c.level, c.best_fixed or DASH, _ratios(c.router_vs), _ratios(c.router_goodput_vs)]
            for c in report.load_comparisons
        ]
        out += [
            Heading(3, "The router against each fixed backend"),
            Table(["level", "best fixed backend", "router tokens/s over", "router goodput over"], comp),
        ]
    return out


def _price_label(row: SizingRow) -> str:
    """'(assumed: N cores × $X/core-hour)' for a price derived from the $/core-hour rate."""
    if row.assumed_cores is None or row.assumed_core_hour_usd is None:
        return "(assumed)"
    return f"(assumed: {row.assumed_cores} cores × {_usd(row.assumed_core_hour_usd)}/core-hour)"


def _sizing(report: Report) -> list[Block]:
    rows = []
    for r in report.sizing:
        replicas = str(r.replicas) if r.replicas is not None else f"> {r.replicas_tried}"
        price = _usd(r.replica_hour_usd) + (f" {_price_label(r)}" if r.price_assumed else "")
        rows.append(
            [
                r.backend + ("" if r.eligible else f" ({r.ineligible_reason or 'not allowed'})"),
                replicas,
                _pct(r.attainment),
                _f(r.ttft_p99_ms, 1),
                _f(r.tpot_p99_ms, 1),
                _f(r.e2e_p99_ms, 1),
                _f(r.tokens_per_s, 1),
                _f(r.capacity_tokens_per_s, 1),
                _pct(r.utilization),
                _f(r.mean_requests, 2),
                price,
                _usd(r.usd_per_million_tokens),
                _usd(r.usd_per_million_tokens_busy),
            ]
        )
    memory = [
        [
            r.backend,
            _mib(r.memory.weights_bytes),
            _mib(r.memory.drafter_bytes),
            _mib(r.memory.kv_bytes),
            _mib(r.memory.total_bytes),
            str(r.memory.planned_batch),
        ]
        for r in report.sizing
    ]
    headers = [
        "backend",
        "replicas",
        "SLO attainment",
        "TTFT p99 (ms)",
        "TPOT p99 (ms)",
        "e2e p99 (ms)",
        "tokens/s served",
        "tokens/s per replica saturated",
        "busy (≥ 1 request admitted)",
        "mean requests per replica",
        "$/replica-hour",
        "$/1M tokens at the operating point (idle time included)",
        "$/1M tokens saturated",
    ]
    return [
        Heading(2, HEADINGS[7]),
        Para("What serving the whole workload takes on each backend alone, and on the router (auto)."),
        Table(headers, rows),
        *_images(report, "sizing"),
        Heading(3, "Memory per replica (MiB)"),
        Table(["backend", "weights", "drafters", "KV cache at the planned batch", "total", "planned batch"], memory),
    ]


def _validation(report: Report) -> list[Block]:
    val = report.validation
    out: list[Block] = [Heading(3, "The simulation against the measurements")]
    if not val.rows:
        return out + [
            Para(
                f"Nothing measured to validate the simulation against (tolerance {_pct(val.tolerance)}): "
                "the what-if figures below are unvalidated.",
                callout=True,
            ),
            *_how_to_get(report, "bench load"),
        ]
    rows = [
        [
            r.level,
            r.mode,
            _f(r.measured_tokens_per_s, 1),
            _f(r.simulated_tokens_per_s, 1),
            _pct(r.tokens_error, signed=True),
            _f(r.measured_e2e_p50_ms, 1),
            _f(r.simulated_e2e_p50_ms, 1),
            _pct(r.e2e_error, signed=True),
            _f(r.measured_ttft_p50_ms, 1),
            _f(r.simulated_ttft_p50_ms, 1),
        ]
        for r in val.rows
    ]
    headers = [
        "level",
        "mode",
        "measured tokens/s",
        "simulated tokens/s",
        "tokens/s error",
        "measured e2e p50 (ms)",
        "simulated e2e p50 (ms)",
        "e2e error",
        "measured TTFT p50 (ms)",
        "simulated TTFT p50 (ms)",
    ]
    verdict = {True: "within tolerance", False: "NOT within tolerance", None: "not judged"}[val.within_tolerance]
    summary = (
        f"Closed-loop cells: mean |tokens/s error| {_pct(val.mean_abs_tokens_error)} (signed "
        f"{_pct(val.signed_tokens_error, signed=True)}: above 0 the simulation is faster); every cell: mean |e2e p50 "
        f"error| {_pct(val.mean_abs_e2e_error)} (signed {_pct(val.signed_e2e_error, signed=True)}: below 0 the "
        f"simulation is faster). An open loop's tokens/s is set by its arrivals, so only closed loops judge it. "
        f"Tolerance {_pct(val.tolerance)}: {verdict}."
    )
    return out + [Table(headers, rows), Para(summary, strong=True), *_images(report, "validation")]


def _what_if(report: Report) -> list[Block]:
    out: list[Block] = [Heading(2, HEADINGS[8]), *_validation(report), Heading(3, "What-if scenarios")]
    if not report.what_if:
        return out + [Para("No what-if scenarios in the report."), *_images(report, "what-if")]
    rows = [
        [
            w.scenario,
            w.backend,
            str(w.replicas),
            f"{_general(w.load_factor)}×",
            w.profile,
            _pct(w.attainment),
            _f(w.ttft_p99_ms, 1),
            _f(w.tpot_p99_ms, 1),
            _f(w.e2e_p99_ms, 1),
            _f(w.tokens_per_s, 1),
            _yes(w.meets_slo),
        ]
        for w in report.what_if
    ]
    headers = [
        "scenario",
        "backend",
        "replicas",
        "load",
        "profile",
        "SLO attainment",
        "TTFT p99 (ms)",
        "TPOT p99 (ms)",
        "e2e p99 (ms)",
        "tokens/s",
        "meets SLO",
    ]
    return out + [*_images(report, "what-if"), Table(headers, rows)]


def _recommendation(report: Report) -> list[Block]:
    rec = report.recommendation
    replicas = f"{rec.replicas} replicas" if rec.replicas is not None else "replicas: not met within the most tried"
    return [
        Heading(2, HEADINGS[9]),
        Para(rec.headline, strong=True, callout=True),
        Para(f"Deploy: {rec.backend}, {replicas}."),
        Heading(3, "Why"),
        Bullets(rec.reasons) if rec.reasons else Para(DASH),
        Heading(3, "Uncertainty"),
        Bullets(rec.uncertainty) if rec.uncertainty else Para(DASH),
    ]


def _notes(report: Report) -> list[Block]:
    out: list[Block] = [Heading(2, HEADINGS[10]), Bullets(report.notes) if report.notes else Para("No notes.")]
    others = [p for p in report.plots if p.name not in PLOT_SLOTS]
    return out + ([Heading(3, "Other plots"), *(Image(p) for p in others)] if others else [])


def _images(report: Report, slot: str) -> list[Block]:
    return [Image(p) for p in report.plots if PLOT_SLOTS.get(p.name) == slot]


def blocks(report: Report) -> list[Block]:
    """The page, in order; both renderers draw exactly these."""
    return [
        *_header(report),
        *_tradeoff(report),
        *_heatmap(report),
        *_concurrency(report),
        *_load(report),
        *_sizing(report),
        *_what_if(report),
        *_recommendation(report),
        *_notes(report),
    ]


# --- Markdown ----------------------------------------------------------------------------------


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_block(b: Block) -> str:
    match b:
        case Heading(level, text):
            return f"{'#' * level} {text}"
        case Para(text, strong, callout):
            text = f"**{text}**" if strong else text
            return f"> {text}" if callout else text
        case Table(headers, rows):
            lines = ["| " + " | ".join(_md_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
            return "\n".join(lines + ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows])
        case Bullets(items):
            return "\n".join(f"- {item}" for item in items)
        case Formula(lines):
            return "```text\n" + "\n".join(lines) + "\n```"
        case Image(plot):
            return f"![{plot.title}]({plot.name})\n\n*{plot.caption}*"
    raise TypeError(f"not a block: {b!r}")


def render_markdown(report: Report) -> str:
    return "\n\n".join(_md_block(b) for b in blocks(report)) + "\n"


# --- HTML --------------------------------------------------------------------------------------

STYLE = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328; margin: 0; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 20px 64px; }
h1 { font-size: 1.7em; margin-bottom: 0.2em; }
h2 { margin-top: 2em; border-bottom: 1px solid #d0d7de; padding-bottom: 0.2em; }
.scroll { overflow-x: auto; margin: 0.8em 0; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
tr:nth-child(even) td { background: #fbfcfd; }
pre.eq { background: #f6f8fa; padding: 10px 12px; border-radius: 6px; overflow-x: auto; font-size: 0.9em; }
.callout { background: #fff8e1; border-left: 4px solid #f0b400; padding: 8px 12px; }
figure { margin: 1.2em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
figcaption { color: #57606a; font-size: 0.9em; }
"""


def _data_uri(plot: Plot, out_dir: Path) -> str:
    path = out_dir / plot.name
    if not path.is_file():
        raise FileNotFoundError(f"plot {plot.name} is listed in the report but {path} does not exist")
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _html_block(b: Block, out_dir: Path) -> str:
    e = html.escape
    match b:
        case Heading(level, text):
            return f"<h{level}>{e(text)}</h{level}>"
        case Para(text, strong, callout):
            inner = f"<strong>{e(text)}</strong>" if strong else e(text)
            return f'<p class="callout">{inner}</p>' if callout else f"<p>{inner}</p>"
        case Table(headers, rows):
            head = "".join(f"<th>{e(h)}</th>" for h in headers)
            body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
            return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
        case Bullets(items):
            return "<ul>" + "".join(f"<li>{e(item)}</li>" for item in items) + "</ul>"
        case Formula(lines):
            return '<pre class="eq">' + e("\n".join(lines)) + "</pre>"
        case Image(plot):
            src = _data_uri(plot, out_dir)
            return f'<figure><img src="{src}" alt="{e(plot.title)}"><figcaption>{e(plot.caption)}</figcaption></figure>'
    raise TypeError(f"not a block: {b!r}")


def render_html(report: Report, out_dir: Path) -> str:
    """One page with every plot embedded as a data URI, so report.html can be mailed on its own."""
    body = "\n".join(_html_block(b, out_dir) for b in blocks(report))
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(report.title)}</title>\n<style>{STYLE}</style>\n</head>\n"
        f"<body>\n<main>\n{body}\n</main>\n</body>\n</html>\n"
    )


# --- files -------------------------------------------------------------------------------------


def write_report(report: Report, out_dir: Path) -> None:
    """Draws the plots (setting report.plots), then writes report.json, report.md and report.html."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report.plots = draw_plots(report, out_dir)
    _write(out_dir / "report.json", report.model_dump_json(indent=1) + "\n")
    _write(out_dir / "report.md", render_markdown(report))
    _write(out_dir / "report.html", render_html(report, out_dir))


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def load_report(path: Path) -> Report:
    return Report.model_validate_json(path.read_text(encoding="utf-8"))
