"""The report page, as Markdown and HTML: every section in order, the numbers that matter, the
plots embedded, a pure function of report.json, and no number on the page that report.json does
not hold."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from router.report.data import Report
from router.report.render import HEADINGS, load_report, render_html, render_markdown, write_report
from tests.chromium import render
from tests.router.report.sample import sample_report

SECTIONS = [
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
]
NUMBER = re.compile(r"\d+(?:\.\d+)?")


@pytest.fixture(scope="module")
def written_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Report]:
    """The sample written out, and the Report object write_report was given."""
    out = tmp_path_factory.mktemp("report")
    report = sample_report()
    assert report.plots == []
    write_report(report, out)
    return out, report


@pytest.fixture(scope="module")
def written(written_report: tuple[Path, Report]) -> Path:
    return written_report[0]


@pytest.fixture(scope="module")
def written_without_load(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report-no-load")
    write_report(sample_report(with_load=False), out)
    return out


def _md(out: Path) -> str:
    return (out / "report.md").read_text(encoding="utf-8")


def _html(out: Path) -> str:
    return (out / "report.html").read_text(encoding="utf-8")


def _text(page: str) -> str:
    """The HTML's visible text, roughly: tags out, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


# --- the number check -------------------------------------------------------------------------


class Explained:
    """The numbers report.json explains: each numeric value (also ×100 as a percent and /2**20
    as MiB) at any printed precision, and the numbers written inside its strings and keys. An
    integer on the page must be an integer in the JSON, an integer-valued float, or appear in a
    string (k = 4, a year, '10× load'); a decimal must be some value rounded to the decimals
    printed. Signs are ignored: the page prints errors as −7.0% and +4.0%."""

    def __init__(self, doc: Any) -> None:
        self.values: list[float] = []
        self.words: set[str] = set()
        self._walk(doc)
        self.integers = {int(v) for v in self.values if float(v).is_integer()}
        self.integers |= {int(w) for w in self.words if "." not in w}
        self._formatted: dict[int, set[str]] = {}

    def _walk(self, x: Any) -> None:
        if isinstance(x, bool) or x is None:
            return
        if isinstance(x, int | float):
            self.values.append(abs(float(x)))
        elif isinstance(x, str):
            self.words |= set(NUMBER.findall(x))
        elif isinstance(x, dict):
            for k, v in x.items():
                self.words |= set(NUMBER.findall(str(k)))
                self._walk(v)
        elif isinstance(x, list):
            for v in x:
                self._walk(v)

    def _at(self, decimals: int) -> set[str]:
        if decimals not in self._formatted:
            self._formatted[decimals] = {
                f"{v * scale:.{decimals}f}" for v in self.values for scale in (1.0, 100.0, 1 / 2**20)
            }
        return self._formatted[decimals]

    def __contains__(self, token: str) -> bool:
        if token in self.words:
            return True
        if "." not in token:
            return int(token) in self.integers
        return token in self._at(len(token.split(".")[1]))

    def unexplained(self, page: str) -> list[str]:
        return [t for t in NUMBER.findall(page) if t not in self]


def _explained(out: Path) -> Explained:
    return Explained(json.loads((out / "report.json").read_text(encoding="utf-8")))


@pytest.mark.parametrize("fixture", ["written", "written_without_load"])
def test_every_number_in_the_markdown_is_in_report_json(fixture: str, request: pytest.FixtureRequest) -> None:
    out = request.getfixturevalue(fixture)
    assert _explained(out).unexplained(_md(out)) == []


@pytest.mark.parametrize("inserted", ["42.42", "987654", "0.123", "7.77%"])
def test_a_hard_coded_number_is_caught(written: Path, inserted: str) -> None:
    explained = _explained(written)
    page = _md(written).replace("## 5. Sizing", f"## 5. Sizing\n\nAbout {inserted} of it.")
    assert explained.unexplained(page) == [inserted.rstrip("%")]


def test_the_check_knows_percent_and_mib() -> None:
    explained = Explained({"share": 0.934, "bytes": 988_065_536, "note": "10× load in 2025"})
    for token in ("93.4", "942.3", "0.93", "10", "2025"):
        assert token in explained
    for token in ("93.5", "942.4", "0.94", "11"):
        assert token not in explained


# --- sections and content ---------------------------------------------------------------------


def test_the_module_lists_the_same_sections() -> None:
    assert list(HEADINGS) == SECTIONS


@pytest.mark.parametrize("fixture", ["written", "written_without_load"])
def test_every_section_in_order(fixture: str, request: pytest.FixtureRequest) -> None:
    out = request.getfixturevalue(fixture)
    md, page = _md(out), _html(out)
    md_at = [md.index(f"\n## {s}\n") for s in SECTIONS]
    html_at = [page.index(f"<h2>{html.escape(s)}</h2>") for s in SECTIONS]
    assert md_at == sorted(md_at) and html_at == sorted(html_at)
    assert md.startswith(f"# {sample_report().title}\n")
    assert f"<h1>{html.escape(sample_report().title)}</h1>" in page


def test_acceptance_values_are_shown(written: Path) -> None:
    md, text = _md(written), _text(_html(written))
    for row in sample_report().acceptance:
        line = f"| {row.category} | {row.drafter} | 4 | {row.alpha:.2f} | {row.proposal_rate:.2f} |"
        assert line in md
        assert f"{row.alpha:.2f}" in text


EQUATIONS = [
    # ρ = 1: the textbook form, with the step cost written out.
    "E = (1 − α^(k+1)) / (1 − α) = (1 − 0.78^4) / (1 − 0.78) = 2.86",
    "speedup = E / (k·c + v) = 2.86 / (3·0.246 + 1.17) = 1.50×",
    # ρ < 1: the tokens per step and the step cost as the fields give them.
    "E = (1 − α^(k+1)) / (1 − α) = (1 − 0.71^6) / (1 − 0.71) = 3.01",
    "E' = 1 + ρ·(E − 1) = 1 + 0.93·(3.01 − 1) = 2.87 tokens per step",
    "step cost = k·c + ρ·v + (1 − ρ)·v(1, 0) = 1.33",
    "speedup = E' / step cost = 2.87 / 1.33 = 2.15×",
]


@pytest.mark.parametrize("equation", EQUATIONS)
def test_the_equations_with_numbers(written: Path, equation: str) -> None:
    assert equation in _md(written)
    assert html.escape(equation) in _html(written)


def test_assumed_price_is_labelled(written: Path) -> None:
    for page in (_md(written), _text(_html(written))):
        assert "$0.32 (assumed: 8 cores × $0.0400/core-hour)" in page
        assert "idle time included" in page


def test_a_given_price_carries_no_assumption_label(tmp_path: Path) -> None:
    report = sample_report()
    for row in report.sizing:
        row.price_assumed, row.assumed_cores, row.assumed_core_hour_usd = False, None, None
    assert "(assumed" not in render_markdown(report)


def test_sizing_shows_unmet_and_ineligible(written: Path) -> None:
    md = _md(written)
    assert "| plain | > 16 |" in md
    assert "| quantized (below quality floor) | 2 |" in md
    assert "| auto | 1884.6 | 256.6 | 168.8 | 2309.9 | 12 |" in md  # memory in MiB


def test_missing_inputs_are_called_out(written: Path, written_without_load: Path) -> None:
    assert "compare profile: run `specroute profile` on the other machine" in _md(written)
    md = _md(written_without_load)
    assert "bench load: run `specroute bench load --out bench-load.json`" in md
    assert "No bench load results were given" in md
    assert "Nothing measured to validate the simulation against" in md
    assert "measured tokens/s" not in md  # no validation table
    assert "Nothing measured to validate the simulation against" not in _md(written)
    assert "Tolerance 15.0%: within tolerance." in _md(written)


def test_validation_and_recommendation(written: Path) -> None:
    md = _md(written)
    assert "| c1 | plain | 38.0 | 42.2 | +11.0% |" in md
    rec = sample_report().recommendation
    assert f"> **{rec.headline}**" in md
    for line in [*rec.reasons, *rec.uncertainty]:
        assert f"- {line}" in md


def test_text_is_escaped_in_html(tmp_path: Path) -> None:
    report = sample_report()
    report.notes.append("<script>alert(1)</script> & more")
    page = render_html(report, tmp_path)
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in page


# --- the HTML is self-contained ---------------------------------------------------------------


def test_html_embeds_every_plot(written: Path) -> None:
    report = load_report(written / "report.json")
    page = _html(written)
    images = {alt: src for src, alt in re.findall(r'<img src="([^"]*)" alt="([^"]*)">', page)}
    assert len(images) == len(report.plots) == 6
    for plot in report.plots:
        src = images[html.escape(plot.title)]
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]) == (written / plot.name).read_bytes()
    # Nothing fetched from elsewhere: every src is a data URI, no stylesheet or script links.
    assert all(s.startswith("data:") for s in re.findall(r'src="([^"]*)"', page))
    assert "<link" not in page and "<script" not in page and "url(" not in page and "http" not in page


def test_markdown_refers_to_the_plot_files(written: Path) -> None:
    md = _md(written)
    for plot in load_report(written / "report.json").plots:
        assert f"![{plot.title}]({plot.name})" in md


def test_a_missing_plot_raises(written: Path, tmp_path: Path) -> None:
    report = load_report(written / "report.json")
    for plot in report.plots:
        if plot.name != "sizing.png":
            shutil.copy(written / plot.name, tmp_path / plot.name)
    with pytest.raises(FileNotFoundError, match="sizing.png"):
        render_html(report, tmp_path)


def test_the_page_renders_in_chromium_with_every_image(written: Path, tmp_path: Path) -> None:
    rendered = render(written / "report.html", tmp_path)
    assert not rendered.blank
    assert len(rendered.images) == 6
    assert rendered.missing == []


# --- a pure function of report.json -----------------------------------------------------------


@pytest.mark.parametrize("fixture", ["written", "written_without_load"])
def test_the_page_is_a_pure_function_of_report_json(fixture: str, request: pytest.FixtureRequest) -> None:
    out = request.getfixturevalue(fixture)
    report = load_report(out / "report.json")
    assert isinstance(report, Report) and report.plots
    assert render_markdown(report) == _md(out)
    assert render_html(report, out) == _html(out)


def test_write_report_sets_the_plots(written_report: tuple[Path, Report]) -> None:
    out, report = written_report
    assert [p.name for p in report.plots] == [p.name for p in load_report(out / "report.json").plots]
    assert load_report(out / "report.json") == report
    assert sorted(f.name for f in out.iterdir()) == sorted(
        ["report.json", "report.md", "report.html", *(p.name for p in report.plots)]
    )
