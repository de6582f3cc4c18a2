"""The headless-Chromium rendering check that report tests rely on: it must see real breakage.

These need Chromium and fail (not skip) without it, with the hint to run `make browser`.
"""

import base64
import io
import stat
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests import chromium
from tests.chromium import BLANK_FRACTION, INSTALL_HINT, find_chromium, read_png, render

RED = (255, 0, 0)


def png_bytes(pixels: np.ndarray) -> bytes:
    """The pixels as a PNG file's bytes."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def plot_pixels(width: int, height: int) -> np.ndarray:
    """A red field with a blue-green gradient band: plainly visible, and easy to find again."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:] = RED
    band = slice(height // 3, 2 * height // 3)
    pixels[band, :, 1] = np.linspace(0, 255, width, dtype=np.uint8)
    pixels[band, :, 2] = 255
    pixels[band, :, 0] = 0
    return pixels


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def page(path: Path, body: str) -> Path:
    path.write_text(f"<!doctype html>\n<html><head><meta charset='utf-8'></head><body>{body}</body></html>\n")
    return path


def test_read_png_reads_back_what_was_written(tmp_path: Path) -> None:
    pixels = plot_pixels(64, 40)
    (tmp_path / "p.png").write_bytes(png_bytes(pixels))
    np.testing.assert_array_equal(read_png(tmp_path / "p.png"), pixels)


def test_images_that_load_render_and_are_seen(tmp_path: Path) -> None:
    (tmp_path / "plot.png").write_bytes(png_bytes(plot_pixels(320, 180)))
    (tmp_path / "lazy.png").write_bytes(png_bytes(plot_pixels(50, 20)))
    inline = data_uri(png_bytes(plot_pixels(40, 30)))
    html = page(
        tmp_path / "report.html",
        "<h1>Latency report</h1>"
        '<img src="plot.png" alt="plot">'
        f'<img src="{inline}" alt="inline">'
        # far below the window and lazy (data: URIs never wait): the check must still load it
        '<div style="height:9000px"></div><img loading="lazy" src="lazy.png" alt="lazy">',
    )
    shots = tmp_path / "out"
    rendered = render(html, shots)

    assert rendered.screenshot == (shots / "screenshot.png").resolve()
    assert [(i.natural_width, i.natural_height) for i in rendered.images] == [(320, 180), (40, 30), (50, 20)]
    assert rendered.missing == [] and all(i.loaded for i in rendered.images)
    assert rendered.images[0].src == "plot.png"
    assert rendered.images[1].src == inline[:100] + "..."
    assert not rendered.blank and rendered.foreground_fraction > BLANK_FRACTION
    shot = read_png(rendered.screenshot)
    assert shot.shape[:2] == (2400, 1280)
    red = np.all(np.abs(shot[..., :3].astype(int) - RED) <= 2, axis=-1).sum()
    assert red >= 0.9 * (320 * 180 * 2 // 3), "the PNG file's pixels are not in the screenshot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lazy.png", "out", "plot.png", "report.html"], (
        "probe copy left"
    )


def test_broken_images_are_reported_missing(tmp_path: Path) -> None:
    good = data_uri(png_bytes(plot_pixels(40, 30)))
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"not a png at all " * 20).decode()
    html = page(
        tmp_path / "broken.html",
        f'<p>some text</p><img src="{good}"><img src="figures/missing.png"><img src="{corrupt}">',
    )
    rendered = render(html, tmp_path / "out", width=800, height=600)

    assert len(rendered.images) == 3 and rendered.images[0].loaded
    assert [m.src for m in rendered.missing] == ["figures/missing.png", corrupt[:100] + "..."]
    assert all(m.complete and m.natural_width == 0 for m in rendered.missing)
    assert not rendered.blank


def test_an_empty_page_is_blank(tmp_path: Path) -> None:
    rendered = render(page(tmp_path / "empty.html", ""), tmp_path / "out", width=800, height=600)
    assert rendered.blank and rendered.images == [] and rendered.missing == []
    assert rendered.foreground_fraction < BLANK_FRACTION
    assert read_png(rendered.screenshot).shape[:2] == (600, 800)


def _script(path: Path, text: str) -> Path:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_no_chromium_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no Chromium on PATH") as missing:
        find_chromium()
    assert INSTALL_HINT in str(missing.value) and "make browser" in INSTALL_HINT
    with pytest.raises(RuntimeError, match="make browser"):
        render(page(tmp_path / "p.html", "x"), tmp_path / "out")
    monkeypatch.setenv("CHROMIUM", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="make browser"):
        find_chromium()


def test_a_failing_chromium_shows_its_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _script(tmp_path / "fake-chromium", "echo 'Failed to connect to the bus: dbus' >&2\necho boom >&2\nexit 3\n")
    monkeypatch.setenv("CHROMIUM", str(fake))
    assert find_chromium() == str(fake)
    html = page(tmp_path / "p.html", "x")
    with pytest.raises(RuntimeError, match="exited with 3") as failure:
        render(html, tmp_path / "out")
    assert "boom" in str(failure.value) and "Failed to connect" not in str(failure.value)
    assert not any(p.name.startswith(".p.render-") for p in tmp_path.iterdir()), "probe copy left"

    silent = _script(tmp_path / "silent-chromium", "exit 0\n")
    monkeypatch.setenv("CHROMIUM", str(silent))
    with pytest.raises(RuntimeError, match="load event never fired"):
        render(html, tmp_path / "out")

    slow = _script(tmp_path / "slow-chromium", "exec sleep 30\n")
    monkeypatch.setenv("CHROMIUM", str(slow))
    with pytest.raises(RuntimeError, match="ran past"):
        render(html, tmp_path / "out", timeout_s=1)
    assert chromium.CHROMIUM_FLAGS[:3] == ("--headless", "--no-sandbox", "--disable-gpu")
