"""Renders an HTML page in headless Chromium: a screenshot, and whether every <img> loaded.

Tests of the HTML report use it to check that a page really renders (`render(...).blank` is false)
and that none of its images is broken (`render(...).missing == []`). Chromium comes from Debian's
`chromium` package (`make browser`); the screenshot is read with Pillow.
"""

from __future__ import annotations

import contextlib
import html as html_lib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

# Static flags for a container: root (no sandbox), no display, no GPU, a small /dev/shm. render()
# adds a fresh temporary --user-data-dir per run, so no profile is shared or left behind.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # chromium refuses to run as root with its sandbox on
    "--disable-gpu",
    "--disable-dev-shm-usage",  # containers' /dev/shm is often 64 MB
    "--hide-scrollbars",
    "--force-device-scale-factor=1",  # screenshot pixels == CSS pixels
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--mute-audio",
)
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "install it with `make browser` (Debian package chromium)"

# A screenshot is blank when fewer than this fraction of its pixels differ from its commonest colour
# (at 1280x2400: under ~300 pixels, i.e. not even a short line of text).
BLANK_FRACTION = 1e-4
SRC_CHARS = 100  # data: URIs are cut to this many characters in ImageState.src

_MARKER = "specroute-render-images"
_PROBE = f"""<script>
(() => {{
  // Lazy images far below the window must count too. Chromium loads them for file:// pages today;
  // making them eager keeps it so, before the load event, whatever a later version decides.
  for (const img of document.images) img.loading = "eager";
  window.addEventListener("load", () => {{
    const cut = (s) => (s.startsWith("data:") && s.length > {SRC_CHARS} ? s.slice(0, {SRC_CHARS}) + "..." : s);
    const states = Array.from(document.images, (img) => ({{
      src: cut(img.getAttribute("src") || img.currentSrc || ""),
      complete: img.complete,
      naturalWidth: img.naturalWidth,
      naturalHeight: img.naturalHeight,
    }}));
    const out = document.createElement("pre");
    out.id = "{_MARKER}";
    out.hidden = true;
    out.textContent = JSON.stringify(states);
    (document.body || document.documentElement).appendChild(out);
  }});
}})();
</script>
"""
_DUMPED = re.compile(rf'<pre id="{_MARKER}" hidden="">(.*?)</pre>', re.S)
# Chromium's stderr noise in a container without D-Bus and friends, left out of error messages.
_NOISE = re.compile(r"dbus|Fontconfig|gcm|GetAll|NameHasOwner|unexpected operator")


def find_chromium() -> str:
    """The Chromium binary: $CHROMIUM when set, else the first of CANDIDATES on PATH."""
    env = os.environ.get("CHROMIUM")
    if env:
        found = shutil.which(env)
        if not found:
            raise RuntimeError(f"$CHROMIUM={env!r} is not an executable; unset it or {INSTALL_HINT}")
        return found
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(f"no Chromium on PATH (tried {', '.join(CANDIDATES)}): {INSTALL_HINT}")


@dataclass
class ImageState:
    """One <img> after the page's load event, as the page saw it."""

    src: str  # the src attribute as written (data: URIs cut to SRC_CHARS characters)
    complete: bool
    natural_width: int
    natural_height: int

    @property
    def loaded(self) -> bool:
        # A broken image is `complete` too (its load failed), but has no natural size.
        return self.complete and self.natural_width > 0


@dataclass
class Rendered:
    screenshot: Path
    images: list[ImageState]
    blank: bool
    foreground_fraction: float = 0.0  # of pixels not of the commonest colour (see BLANK_FRACTION)

    @property
    def missing(self) -> list[ImageState]:
        return [img for img in self.images if not img.loaded]


def render(html: Path, out_dir: Path, width: int = 1280, height: int = 2400, timeout_s: float = 60) -> Rendered:
    """Renders `html` at width x height into out_dir/screenshot.png and reports its images.

    A probing copy of the page is written next to it (so relative image paths resolve the same),
    loaded once for both its DOM (the probe's image report) and the screenshot, then removed.
    Chromium builds that take only one of --dump-dom and --screenshot per run get a second run.
    timeout_s bounds all of it; up to half of it (at most 10 s) is virtual time for loads to finish.
    """
    html = Path(html).resolve()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    screenshot = (out_dir / "screenshot.png").resolve()
    screenshot.unlink(missing_ok=True)
    binary = find_chromium()
    deadline = time.monotonic() + timeout_s
    page = html.read_text(encoding="utf-8")
    at = page.lower().rfind("</body>")
    probed = page[:at] + _PROBE + page[at:] if at >= 0 else page + _PROBE
    copy = html.with_name(f".{html.stem}.render-{uuid.uuid4().hex[:8]}.html")
    copy.write_text(probed, encoding="utf-8")
    common = [f"--virtual-time-budget={int(min(timeout_s / 2, 10) * 1000)}", f"--window-size={width},{height}"]
    try:
        run = _chromium(binary, [*common, "--dump-dom", f"--screenshot={screenshot}", copy.as_uri()], deadline)
        found = _DUMPED.search(run.stdout)
        if not found:
            raise RuntimeError(
                f"chromium's DOM of {html} has no image report: the page's load event never fired" + _tail(run)
            )
        states = json.loads(html_lib.unescape(found.group(1)))
        if not screenshot.is_file():
            run = _chromium(binary, [*common, f"--screenshot={screenshot}", copy.as_uri()], deadline)
        if not screenshot.is_file() or screenshot.stat().st_size == 0:
            raise RuntimeError(f"chromium wrote no screenshot of {html} to {screenshot}" + _tail(run))
    finally:
        copy.unlink(missing_ok=True)
    images = [
        ImageState(
            src=s["src"],
            complete=bool(s["complete"]),
            natural_width=int(s["naturalWidth"]),
            natural_height=int(s["naturalHeight"]),
        )
        for s in states
    ]
    fraction = foreground_fraction(read_png(screenshot))
    return Rendered(screenshot, images, blank=fraction < BLANK_FRACTION, foreground_fraction=fraction)


def _chromium(binary: str, args: list[str], deadline: float) -> subprocess.CompletedProcess[str]:
    timeout_s = max(deadline - time.monotonic(), 1.0)
    with tempfile.TemporaryDirectory(prefix="specroute-chromium-", ignore_cleanup_errors=True) as profile:
        cmd = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
        # Its own session, so a timeout takes the browser's helper processes down with it.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                stdout, stderr = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a helper that left the group still holds the pipes
                stdout, stderr = "", ""
            done = subprocess.CompletedProcess(cmd, -9, stdout, stderr)
            raise RuntimeError(f"chromium ran past {timeout_s:g} s: {' '.join(cmd)}" + _tail(done)) from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited with {proc.returncode}: {' '.join(cmd)}" + _tail(done))
    return done


def _tail(done: subprocess.CompletedProcess[str], lines: int = 20) -> str:
    kept = [line for line in (done.stderr or "").splitlines() if line.strip() and not _NOISE.search(line)]
    return "\nchromium's stderr (last lines, D-Bus noise left out):\n" + "\n".join(kept[-lines:] or ["(empty)"])


def foreground_fraction(pixels: np.ndarray) -> float:
    """The fraction of pixels whose colour differs from the image's commonest (the background's).

    The commonest colour is taken from every 61st pixel, then counted exactly over all of them.
    """
    flat = pixels.reshape(-1, pixels.shape[2])  # (h, w, c) as read_png gives it
    if not len(flat):
        return 0.0
    packed = np.zeros(len(flat), dtype=np.uint32)
    for channel in range(flat.shape[1]):
        packed = (packed << 8) | flat[:, channel].astype(np.uint32)
    colours, counts = np.unique(packed[::61], return_counts=True)
    return float(np.count_nonzero(packed != colours[counts.argmax()]) / len(packed))


def read_png(path: Path) -> np.ndarray:
    """A screenshot as a (h, w, 3) uint8 array."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))
