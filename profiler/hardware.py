"""What machine a measurement ran on, and its memory bandwidth measured in the same run:
the physical limit a memory-bound decode step is compared against."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch
from pydantic import BaseModel


class MachineInfo(BaseModel):
    cpu: str
    logical_cores: int
    torch_threads: int
    torch_version: str
    transformers_version: str
    python_version: str
    cuda_device: str | None


def machine_info() -> MachineInfo:
    return MachineInfo(
        cpu=_cpu_model(),
        logical_cores=os.cpu_count() or 1,
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        transformers_version=version("transformers"),
        python_version=platform.python_version(),
        cuda_device=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )


# CPU flags of bfloat16 arithmetic in hardware (Linux /proc/cpuinfo names); without them torch
# converts bfloat16 to float32 and back around every product, and bfloat16 saves bytes only.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
NO_FAST_BF16 = "this CPU has no bfloat16 arithmetic (neither AVX-512 BF16 nor AMX)"


def fast_reduced_precision(device: str = "cpu") -> bool:
    """Whether bfloat16 runs natively here: a CUDA device that supports it, or a CPU with the flags."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(set(BF16_CPU_FLAGS) & cpu_flags())


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def measure_copy_bandwidth(megabytes: int = 256, repeats: int = 5, device: str = "cpu") -> float:
    """Best-of-`repeats` device memory copy bandwidth in bytes/s (read + write counted, as STREAM does).

    The buffer is far larger than any CPU cache, so this is what DRAM (or HBM) sustains.
    """
    elements = megabytes * 2**20 // 4
    src = torch.ones(elements, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch pages outside the timed region
    return 2 * src.numel() * src.element_size() / _best_seconds(lambda: dst.copy_(src), repeats, device)


def measure_matvec_bandwidth(layer: torch.nn.Linear, repeats: int = 10) -> float:
    """Best-of-`repeats` bytes/s of one matrix-vector product through `layer` (its weight counted
    once), with the kernel the layer runs (packed or torch's own, see `backends.packing`).

    A batch-1 decode step is a chain of these; this is the ceiling that kernel reaches on this
    machine, which can sit well below the copy bandwidth.
    """
    weight = layer.weight
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.inference_mode():
        layer(x)  # warm-up outside the timed region (a packed layer packs its weight here)
        seconds = _best_seconds(lambda: layer(x), repeats, weight.device.type)
    return weight.numel() * weight.element_size() / seconds


def _best_seconds(run: Callable[[], object], repeats: int, device: str) -> float:
    """Fastest of `repeats` timed calls: the least disturbed by whatever else the machine does."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
