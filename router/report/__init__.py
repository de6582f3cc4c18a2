"""Capacity-planning reports (`specroute report`): `data` is report.json's schema, `build` fills it
from the measurements and the simulation, `plots` and `render` draw the page from it alone, and
`measure` runs what is missing when asked. The service serves the latest one at `/report`."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from backends.embedded import specroute_home

REPORT_FILES = ("report.html", "report.md", "report.json")


def latest_dir() -> Path:
    """Where the newest report is kept for the service's `/report`."""
    return specroute_home() / "reports" / "latest"


def publish(out_dir: Path, latest: Path | None = None) -> Path:
    """Copy a written report (page, JSON, plots) into a folder of its own beside `latest`, then
    point the `latest` link at it in one rename: a reader sees the old report or the new one,
    never none or half of each. The previous folder is kept (a reader may still be in it)."""
    latest = latest or latest_dir()
    latest.parent.mkdir(parents=True, exist_ok=True)
    folder = latest.with_name(f"report-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}")
    folder.mkdir()
    for path in out_dir.iterdir():
        if path.name in REPORT_FILES or path.suffix == ".png":
            shutil.copy2(path, folder / path.name)
    if latest.is_dir() and not latest.is_symlink():  # not ours: a folder someone made by hand
        shutil.rmtree(latest)
    link = latest.with_name(latest.name + ".link")
    link.unlink(missing_ok=True)
    link.symlink_to(folder.name)
    previous = latest.resolve() if latest.is_symlink() else None
    os.replace(link, latest)
    for old in latest.parent.glob("report-*"):
        if old not in (folder, previous) and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return latest
