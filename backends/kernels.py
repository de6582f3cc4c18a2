"""Which linear kernels a CPU model runs, chosen by measuring both on this machine.

Packed layers (`backends/packing.py`) are 1.3–1.4× faster per float32 pass than torch's own linear
on one CPU seen here (AMD EPYC, oneDNN's blocked kernels against MKL's GEMM), and 1.5× *slower*
at one position on another (an Intel Xeon with AMX, where MKL's matrix-vector product is the
fast one). No rule of thumb over CPU flags predicts that, so the load measures: a pass of one
position (a decode step) and one of nine (a verification or a width-invariant tile) over the
paged cache, packed and torch's linear alternating, best of a few rounds. Packing also costs the
weights' memory again, so it must win by `MIN_GAIN` to be chosen.

The choice is kept per machine (CPU model and flags), torch version, thread count, dtype and
model shape under SPECROUTE_HOME, so a machine measures once, a profile and the service that
reads it run the same kernels, and `SPECROUTE_LINEAR_KERNELS=packed|torch` (or
`load_model(linear_kernels=...)`) overrides the measurement.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, Field, ValidationError

from .embedded import specroute_home
from .errors import ModelLoadError
from .packing import pack_linears, packing_available, unpack_linears
from .pass_timing import measure_step_times

log = logging.getLogger("specroute.kernels")

LinearKernel = Literal["packed", "torch"]
LINEAR_KERNEL_SETTINGS = ("auto", "packed", "torch")
KERNELS_ENV = "SPECROUTE_LINEAR_KERNELS"
# Packing doubles the weights' memory: a gain inside the noise of two runs minutes apart
# (a few percent here) does not pay for it.
MIN_GAIN = 1.05
CHOICE_WIDTHS = (1, 9)  # a decode pass; a verification of k = 8 or a width-invariant tile
CHOICE_CONTEXT = 192  # cached tokens: a short chat turn
CHOICE_ROUNDS = 3
CHOICE_REPEATS = 2


class KernelChoice(BaseModel):
    """The linear kernels a model runs and the measurement behind them."""

    kernel: LinearKernel
    source: Literal["measured", "cached", "setting", "unavailable"]
    packed_ms: dict[int, float] = Field(default_factory=dict, description="best pass time by width, packed layers")
    torch_ms: dict[int, float] = Field(default_factory=dict, description="best pass time by width, torch's linear")
    measured_at: str | None = None
    cpu: str | None = None

    def gain(self) -> float | None:
        """torch's linear time over packed, summed over the measured widths (> 1: packed is faster)."""
        if not self.packed_ms or not self.torch_ms:
            return None
        return sum(self.torch_ms.values()) / sum(self.packed_ms.values())

    def reason(self) -> str:
        if self.source == "setting":
            return f"{self.kernel} linear kernels, as set ({KERNELS_ENV} or linear_kernels)"
        if self.source == "unavailable":
            return "torch's linear: this torch build or CPU has no oneDNN packed kernels in this dtype"
        widths = " / ".join(str(w) for w in sorted(self.packed_ms))
        packed = " / ".join(f"{self.packed_ms[w]:.1f}" for w in sorted(self.packed_ms))
        plain = " / ".join(f"{self.torch_ms[w]:.1f}" for w in sorted(self.torch_ms))
        when = "measured now" if self.source == "measured" else f"measured {self.measured_at} on this machine"
        return (
            f"{self.kernel} linear kernels: a pass of {widths} positions took {packed} ms packed against "
            f"{plain} ms with torch's linear ({when}; packing must win by {MIN_GAIN:.2f}×)"
        )


def choose_linear_kernels(model: torch.nn.Module, dtype: str, setting: str | None = None) -> KernelChoice:
    """Apply and return the linear kernels for a CPU `model`: `setting` (default: the
    SPECROUTE_LINEAR_KERNELS variable, else "auto") names them or asks for this machine's measured choice."""
    setting = setting or os.environ.get(KERNELS_ENV) or "auto"
    if setting not in LINEAR_KERNEL_SETTINGS:
        raise ModelLoadError(f"unknown linear kernels '{setting}': use one of {', '.join(LINEAR_KERNEL_SETTINGS)}")
    if not packing_available(getattr(torch, dtype)):
        choice = KernelChoice(kernel="torch", source="unavailable")
    elif setting != "auto":
        choice = KernelChoice(kernel=setting, source="setting")  # type: ignore[arg-type]
    else:
        path = choice_path(model, dtype)
        with _measuring(path):  # replicas loading at once measure one at a time, then read the first's
            choice = _cached(path) or _measured(model, path)
    apply_linear_kernels(model, choice.kernel)
    return choice


def apply_linear_kernels(model: torch.nn.Module, kernel: LinearKernel) -> None:
    (pack_linears if kernel == "packed" else unpack_linears)(model)


def choice_path(model: torch.nn.Module, dtype: str) -> Path:
    """Where this machine's choice for `model` in `dtype` is kept."""
    config = model.config
    key = {
        "cpu": cpu_identity(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "model": {
            k: getattr(config, k, None)
            for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
        },
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return specroute_home() / "kernels" / f"{digest}.json"


def cpu_identity() -> str:
    """The CPU's model name and feature flags: two CPUs sold under one name can differ in both."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first core's line of each
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = " ".join(sorted(fields.get("flags", "").split()))
    return f"{name} [{hashlib.sha256(flags.encode()).hexdigest()[:12]}]"


def time_both(
    model: torch.nn.Module, widths: Sequence[int] = CHOICE_WIDTHS, rounds: int = CHOICE_ROUNDS
) -> dict[LinearKernel, dict[int, float]]:
    """Best milliseconds of a batch-1 pass of each width with each kernel, alternating which goes
    first each round so a slow spell on a noisy machine hits both."""
    best: dict[LinearKernel, dict[int, float]] = {"packed": {}, "torch": {}}
    kernels: tuple[LinearKernel, LinearKernel] = ("packed", "torch")
    for round_ in range(rounds):
        for kernel in kernels if round_ % 2 == 0 else kernels[::-1]:
            apply_linear_kernels(model, kernel)
            times = measure_step_times(model, 1, widths, context=CHOICE_CONTEXT, repeats=CHOICE_REPEATS)
            for width, seconds in times.items():
                best[kernel][width] = min(best[kernel].get(width, float("inf")), seconds * 1e3)
    return best


def _measured(model: torch.nn.Module, path: Path) -> KernelChoice:
    best = time_both(model)
    faster = sum(best["torch"].values()) / sum(best["packed"].values()) >= MIN_GAIN
    choice = KernelChoice(
        kernel="packed" if faster else "torch",
        source="measured",
        packed_ms={w: round(ms, 2) for w, ms in best["packed"].items()},
        torch_ms={w: round(ms, 2) for w, ms in best["torch"].items()},
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        cpu=cpu_identity(),
    )
    try:
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(choice.model_dump_json(indent=2))
        partial.replace(path)
    except OSError as error:  # a read-only home measures again next load; nothing else is lost
        log.warning("could not keep the linear-kernel choice at %s: %s", path, error)
    log.info("%s", choice.reason())
    return choice


@contextmanager
def _measuring(path: Path) -> Iterator[None]:
    """Hold this choice's lock file while it is read or measured (no lock where none can be made:
    a read-only home measures on every load)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 - held across the yield
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cached(path: Path) -> KernelChoice | None:
    try:
        choice = KernelChoice.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        return None  # none yet, or unreadable: measure afresh
    return choice.model_copy(update={"source": "cached"})
