"""The report's plots: each one the report has data for is a real, non-blank PNG; those it has no
data for are not drawn (and a stale one is removed); what they show follows the Report."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from router.report.plots import draw_plots
from tests.router.report.sample import sample_report

FULL = ["heatmap.png", "concurrency.png", "load.png", "validation.png", "sizing.png", "what-if.png"]
WITHOUT_LOAD = ["heatmap.png", "concurrency.png", "sizing.png", "what-if.png"]


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    out = tmp_path_factory.mktemp("full")
    return out, draw_plots(sample_report(), out)


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def _assert_real_plot(path: Path) -> None:
    assert path.stat().st_size > 15_000, f"{path.name} is suspiciously small"
    px = _pixels(path)
    height, width, _ = px.shape
    assert 600 <= width <= 2000 and 400 <= height <= 1400, f"{path.name} is {width}×{height}"
    wide = px.astype(np.int32)
    colours = np.unique((wide[..., 0] << 16) | (wide[..., 1] << 8) | wide[..., 2])
    assert len(colours) > 50, f"{path.name} has {len(colours)} colours"
    # Not a blank canvas: a good share of the pixels are not the white background.
    assert (px.sum(axis=2) < 720).mean() > 0.03, f"{path.name} is nearly all white"


def test_full_report_draws_every_plot(full: tuple[Path, list]) -> None:
    out, plots = full
    assert [p.name for p in plots] == FULL
    for p in plots:
        assert p.title and p.caption
        _assert_real_plot(out / p.name)
    assert not (out / "load-open.png").exists()  # only closed-loop rows in the sample


def test_no_load_data_draws_no_load_or_validation_plot(full: tuple[Path, list], tmp_path: Path) -> None:
    # Over an earlier full run's folder: its load and validation plots must not linger as stale.
    for f in full[0].iterdir():
        shutil.copy(f, tmp_path / f.name)
    plots = draw_plots(sample_report(with_load=False), tmp_path)
    assert [p.name for p in plots] == WITHOUT_LOAD
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(WITHOUT_LOAD)
    for p in plots:
        _assert_real_plot(tmp_path / p.name)


def test_open_loop_plot_drawn_and_what_if_plot_skipped_when_empty(tmp_path: Path) -> None:
    report = sample_report(open_loop=True)
    report.what_if = []
    plots = draw_plots(report, tmp_path)
    names = [p.name for p in plots]
    assert "load.png" in names and "load-open.png" in names
    assert "what-if.png" not in names
    _assert_real_plot(tmp_path / "load-open.png")
    assert "open-loop" in plots[names.index("load-open.png")].title


def test_heatmap_diverges_at_one(full: tuple[Path, list]) -> None:
    """The sample's grid holds speedups both under and over 1.0: red and blue cells both show."""
    px = _pixels(full[0] / "heatmap.png")
    r, b = px[..., 0], px[..., 2]
    assert ((r - b) > 80).sum() > 2000, "no red (slower than plain) region"
    assert ((b - r) > 80).sum() > 2000, "no blue (faster than plain) region"


def test_all_faster_heatmap_has_no_red(tmp_path: Path) -> None:
    report = sample_report()
    report.heatmap.speedup = [[1.2 + 0.1 * j for j, _ in enumerate(row)] for row in report.heatmap.speedup]
    draw_plots(report, tmp_path)
    px = _pixels(tmp_path / "heatmap.png")
    assert ((px[..., 0] - px[..., 2]) > 80).sum() < 200


def test_plots_follow_the_report(full: tuple[Path, list], tmp_path: Path) -> None:
    """What is drawn is read from the Report: changing a field changes that picture, and only it
    (the others come out byte for byte the same, so drawing is deterministic too)."""
    report = sample_report()
    report.sizing[1].replicas = 2
    report.curves[0].predicted[0].speedup = 3.5
    report.validation.tolerance = 0.05
    draw_plots(report, tmp_path)
    changed = {name for name in FULL if (tmp_path / name).read_bytes() != (full[0] / name).read_bytes()}
    assert changed == {"sizing.png", "concurrency.png", "validation.png"}
