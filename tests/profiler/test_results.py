"""Recorded results: the provenance is taken around the run itself, secrets never reach the file,
and a failed run records nothing."""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from pathlib import Path

import pytest

from profiler.results import (
    REDACTED,
    ResultError,
    ResultFile,
    command_line,
    git_state,
    record_run,
    redact,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_reads_as_typed_whatever_directory_the_program_ran_from():
    argv = ["/work/x/.venv/bin/specroute", "bench", "plain", "--batches", "1,4", "--messages", "it's"]
    assert command_line(argv) == "specroute bench plain --batches 1,4 --messages 'it'\"'\"'s'"


@pytest.mark.parametrize(
    "argv", [["specroute", "bench", "load", "--api-key", "s3cret"], ["specroute", "bench", "load", "--api-key=s3cret"]]
)
def test_an_api_key_on_the_command_line_is_redacted(argv):
    line = command_line(argv)
    assert "s3cret" not in line and REDACTED in line


def test_an_api_key_inside_the_result_is_redacted_and_nothing_else_changes():
    data = {"config": {"api_key": "s3cret", "url": "u"}, "cells": [{"api_key": None, "x": 1}]}
    assert redact(data) == {"config": {"api_key": REDACTED, "url": "u"}, "cells": [{"api_key": None, "x": 1}]}


def test_the_git_state_is_the_checkouts_commit():
    revision, dirty = git_state(ROOT)
    assert re.fullmatch(r"[0-9a-f]{40}", revision) and isinstance(dirty, bool)


def test_a_run_is_recorded_with_its_output_and_provenance():
    argv = [sys.executable, "-c", "import json; print(json.dumps({'tokens_per_s': 12.5}))"]
    found = record_run(argv, "bench plain", lambda done: json.loads(done.stdout), ROOT, capture=True)
    assert found.result == {"tokens_per_s": 12.5} and found.kind == "bench plain"
    p = found.provenance
    assert p.cpu and p.logical_cores >= 1 and p.revision == git_state(ROOT)[0]
    assert datetime.fromisoformat(p.started) <= datetime.fromisoformat(p.finished)
    assert p.command.endswith("-c 'import json; print(json.dumps({'\"'\"'tokens_per_s'\"'\"': 12.5}))'")
    assert ResultFile.model_validate_json(found.model_dump_json()) == found


def test_a_failed_run_records_nothing():
    argv = [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(ResultError, match="exited with 3"):
        record_run(argv, "bench plain", lambda done: {}, ROOT, capture=True)


def test_a_command_that_cannot_start_records_nothing():
    with pytest.raises(ResultError, match="could not start"):
        record_run(["/nonexistent/specroute", "bench", "plain"], "bench plain", lambda done: {}, ROOT, capture=True)
