"""`specroute bench invariance`: does a request's greedy output depend on how it was computed? On
the held-out prompts, in the target's dtype on this machine, with width-invariant passes for a
lone sequence only (the default), for every pass, and off: speculative against plain decoding at
batch 1 (what "lossless" promises), and a row decoded among others against the same row decoded
alone (batch invariance), plain and speculative; plus what the plain loop decodes per second alone
and in the largest batch in each mode, so the tiles' cost sits beside what they buy."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field
from tqdm import tqdm

from backends.generation import GenerationRequest
from backends.scheduler import LoopSettings, Scheduler
from backends.speculative.engine import SpeculativeEngine
from backends.speculative.factory import build_drafter
from policies.drafters import DrafterConfig, DrafterKind

from .hardware import MachineInfo, machine_info
from .settings import LoopBenchTarget, load_target
from .workloads import load_prompt_set

Mode = Literal["alone", "every-pass", "off"]
# Each mode's loop settings: tiles on passes of one sequence (the default), on every pass, on none.
MODES: dict[str, LoopSettings] = {
    # Prompts repeat across batches: cached prefixes would change how each prompt is prefilled.
    "alone": LoopSettings(width_invariant="on", tile_max_rows=1, prefix_caching=False),
    "every-pass": LoopSettings(width_invariant="on", tile_max_rows=None, prefix_caching=False),
    "off": LoopSettings(width_invariant="off", prefix_caching=False),
}


class BenchInvarianceConfig(LoopBenchTarget):
    prompts_per_category: int = Field(2, ge=1, le=7, description="held-out prompts per category")
    categories: list[str] | None = Field(None, description="default: every category of the held-out set")
    max_tokens: int = Field(32, ge=1, le=1024)
    batch_sizes: list[Annotated[int, Field(ge=2)]] = Field(default_factory=lambda: [2, 4, 8], min_length=1)
    drafter: DrafterKind = "ngram"
    k: int | Literal["auto"] = Field(
        "auto", description="the speculative loop's k: auto, or fixed (every proposal verified, so every width is)"
    )

    @property
    def modes(self) -> dict[str, LoopSettings]:
        """The width-invariance modes this engine has, each as its loops' settings."""
        if self.engine != "torch":  # tiles are the torch engine's: other engines run natural widths
            return {"off": MODES["off"].model_copy(update={"engine": self.engine, "gguf_weights": self.gguf_weights})}
        return MODES


class Agreement(BaseModel):
    width_invariant: Mode
    compared: str = Field(description="which outputs face which")
    batch_size: int
    prompts: int
    identical: int = Field(description="prompts whose greedy tokens agree token for token")


class PlainSpeed(BaseModel):
    width_invariant: Mode
    tile: int | None = Field(description="positions per decode pass (None: natural widths)")
    tokens_per_s: float = Field(description="the plain loop, one request at a time")
    batch_size: int = Field(description="the largest batch compared")
    batched_tokens_per_s: float = Field(description="the plain loop in static batches of batch_size")


class BenchInvarianceReport(BaseModel):
    machine: MachineInfo
    model: dict[str, object]
    engine: str = "torch"
    gguf_weights: str = Field("file", description="the llama.cpp engine's weights (file: the GGUF file as shipped)")
    k: str = "auto"
    drafter: str
    agreements: list[Agreement]
    speeds: list[PlainSpeed]


def run_bench_invariance(config: BenchInvarianceConfig) -> BenchInvarianceReport:
    prompt_set = load_prompt_set("heldout")
    unknown = sorted(set(config.categories or ()) - set(prompt_set.categories))
    if unknown:  # before loading anything
        raise ValueError(f"unknown categories {unknown}: choose from {sorted(prompt_set.categories)}")
    loaded = load_target(config)
    requests = [
        GenerationRequest(messages=p.messages, max_tokens=config.max_tokens)
        for name in config.categories or list(prompt_set.categories)
        for p in prompt_set.categories[name].prompts[: config.prompts_per_category]
    ]
    drafter = build_drafter(DrafterConfig(kind=config.drafter), loaded)
    agreements, speeds = [], []
    runs = len(config.modes) * len(requests) * (2 + 2 * len(config.batch_sizes))
    with tqdm(total=runs, desc="bench invariance", unit="request", leave=False) as bar:
        for mode, settings in config.modes.items():
            plain = Scheduler(loaded, settings)
            speculative = SpeculativeEngine(loaded, drafter.fresh(), k=config.k, settings=settings)
            found, speed = _compare(mode, plain, speculative, requests, config.batch_sizes, bar)
            agreements += found
            speeds.append(speed.model_copy(update={"tile": plain.tile}))
    return BenchInvarianceReport(
        machine=machine_info(),
        model=loaded.info.as_dict(),
        engine=config.engine,
        gguf_weights=config.gguf_weights,
        k=str(config.k),
        drafter=drafter.name,
        agreements=agreements,
        speeds=speeds,
    )


def _compare(
    mode: Mode,
    plain: Scheduler,
    speculative: SpeculativeEngine,
    requests: list[GenerationRequest],
    batch_sizes: list[int],
    bar: tqdm,
) -> tuple[list[Agreement], PlainSpeed]:
    """Every comparison in one mode, each against the plain loop's outputs alone; and the plain
    loop's tokens per second alone and in the largest batch."""
    # Untimed first: a loop's first passes of each shape set up their kernels (bfloat16 on CPU
    # especially), which would otherwise count against whichever mode runs first.
    for warm in (requests[:1], requests[: max(batch_sizes)]):
        plain.generate(warm)
    started, alone = time.perf_counter(), _one_by_one(plain, requests, bar)
    speed = sum(len(t) for t in alone) / (time.perf_counter() - started)
    batched_speed = 0.0

    def agreement(compared: str, batch: int, outputs: list[list[int]]) -> Agreement:
        same = sum(a == b for a, b in zip(alone, outputs, strict=True))
        return Agreement(width_invariant=mode, compared=compared, batch_size=batch, prompts=len(alone), identical=same)

    found = [agreement("speculative vs plain", 1, _one_by_one(speculative, requests, bar))]
    for size in batch_sizes:
        started = time.perf_counter()
        batched = _batched(plain, requests, size, bar)
        batched_speed = sum(len(t) for t in batched) / (time.perf_counter() - started)
        found.append(agreement("plain batched vs plain alone", size, batched))
        found.append(agreement("speculative batched vs plain alone", size, _batched(speculative, requests, size, bar)))
    largest = max(batch_sizes)
    return found, PlainSpeed(
        width_invariant=mode, tile=None, tokens_per_s=speed, batch_size=largest, batched_tokens_per_s=batched_speed
    )


def _one_by_one(loop: Scheduler, requests: list[GenerationRequest], bar: tqdm) -> list[list[int]]:
    outputs = []
    for request in requests:
        outputs.append(loop.generate([request])[0].token_ids)
        bar.update()
    return outputs


def _batched(loop: Scheduler, requests: list[GenerationRequest], size: int, bar: tqdm) -> list[list[int]]:
    """The requests in consecutive groups of `size`, each group one static batch from the start."""
    outputs = []
    for first in range(0, len(requests), size):
        group = requests[first : first + size]
        outputs += [r.token_ids for r in loop.generate(group)]
        bar.update(len(group))
    return outputs


def render_report(report: BenchInvarianceReport) -> str:
    m = report.model
    engine = f"{report.engine} engine" + ("" if report.gguf_weights == "file" else f", {report.gguf_weights} weights")
    lines = [
        f"specroute bench invariance — {m['name']} ({m['dtype']}, {m['device']}, {engine}) on "
        f"{report.machine.cpu}, {report.machine.torch_threads} threads; greedy; drafter {report.drafter} "
        f"(k {report.k})",
        "",
        "  tiled passes     compared                              batch  identical",
    ]
    lines += [
        f"  {a.width_invariant:15s}  {a.compared:36s}  {a.batch_size:5d}  {a.identical:3d} of {a.prompts}"
        for a in report.agreements
    ]
    lines += ["", "plain loop, one request at a time and in the largest batch:"]
    lines += [
        f"  tiled passes {s.width_invariant:10s} ({'tile ' + str(s.tile) if s.tile else 'natural widths'}): "
        f"{s.tokens_per_s:.1f} tok/s alone, {s.batched_tokens_per_s:.1f} tok/s in batches of {s.batch_size}"
        for s in report.speeds
    ]
    return "\n".join(lines)
