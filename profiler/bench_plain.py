"""`specroute bench plain`: the plain engine against transformers' `model.generate` on the same
prompts in the same run (interleaved, so machine noise hits both alike), tokens/s as the batch
grows, and how close a batch-1 decode step comes to the machine's memory bandwidth — with the
linear layers packed (`backends.packing`) and with torch's own linear, alternating in the same
run, beside which of the two the load chose for this machine (`backends.kernels`). Where llama.cpp
is installed and the model is a GGUF file, the step loop on the llama.cpp engine runs beside
llama.cpp's own generation of the same file and the torch step loop (interleaved too), and its
tokens/s as the batch grows."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Annotated

import torch
from pydantic import BaseModel, Field
from tqdm import tqdm
from transformers import GenerationConfig

from backends.engines import gguf_file
from backends.engines.llamacpp import (
    gguf_weight_types,
    llama_unavailable,
    measure_llamacpp_step_times,
    pass_variance,
)
from backends.generation import ChatMessage, GenerationRequest
from backends.kernels import apply_linear_kernels
from backends.models import LoadedModel
from backends.packing import packing_available
from backends.plain import PlainEngine
from backends.quantized import Reference
from backends.scheduler import LoopSettings, Scheduler
from policies.config import QuantizationConfig
from policies.engines import GgufWeights

from .hardware import MachineInfo, machine_info, measure_copy_bandwidth, measure_matvec_bandwidth
from .peers import LlamaCppPeer
from .profiling import measure_gguf_quality, quality_reference
from .settings import BenchTarget, load_target

BENCH_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that checks whether a number is prime.",
    "Summarize the story of a lighthouse keeper who finds a message in a bottle.",
    "List three tips for staying productive while working from home.",
)


PASS_COST_DRAFTS = (1, 2, 4, 8)  # the k whose v(1, k) the llama.cpp section reports


class BenchPlainConfig(BenchTarget):
    max_tokens: int = Field(48, ge=2, le=4096)
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 4, 16, 64], min_length=1)
    rounds: int = Field(3, ge=1)
    gguf_weights: list[GgufWeights] = Field(
        default_factory=lambda: ["file", "Q4_0", "Q8_0", "F16"],
        min_length=1,
        description="the weight types the llama.cpp section runs (file: the GGUF file as shipped)",
    )
    quality_prompts: int = Field(2, ge=1, description="held-out quality prompts per category, per weight type")
    quality_tokens: int = Field(32, ge=1, le=512, description="greedy tokens per quality prompt")
    min_agreement: float = Field(
        QuantizationConfig().min_agreement, ge=0, le=1, description="the quality floor the weights are held to"
    )


class GenerateComparison(BaseModel):
    requests: int = Field(description="prompts × rounds, each timed once per engine")
    tokens_per_request: int
    specroute_tokens_per_s: float
    transformers_tokens_per_s: float
    ratio: float = Field(description="specroute tokens/s over transformers generate tokens/s")
    identical_tokens: bool = Field(description="greedy outputs of both engines match token for token")


class BatchPoint(BaseModel):
    batch_size: int
    tokens_per_s: float = Field(description="generated tokens of the whole batch per wall second")
    step_ms: float = Field(description="one decode step of the batch, prefill excluded")


class BandwidthUse(BaseModel):
    weight_bytes: int
    decode_step_ms: float = Field(description="batch-1 decode step, prefill excluded")
    achieved_bytes_per_s: float = Field(description="weight bytes × decode steps per second")
    copy_bytes_per_s: float = Field(description="memory copy bandwidth measured in this run")
    fraction: float = Field(description="achieved over copy bandwidth")
    matvec_bytes_per_s: float = Field(
        description="one matrix-vector product through the LM head (the kernel the step runs), measured in this run"
    )
    matvec_fraction: float = Field(description="achieved over the matrix-vector ceiling")
    linear_kernels: str | None = Field(None, description="the kernels the load chose and the step above ran (CPU)")
    kernels_reason: str | None = Field(None, description="why the load chose them")
    packed_decode_step_ms: float | None = Field(
        None, description="the step with packed linear layers, alternating with torch's linear (CPU with oneDNN)"
    )
    torch_decode_step_ms: float | None = Field(None, description="the step with torch's own linear layers")

    def fraction_at(self, step_ms: float) -> float:
        """A step of `step_ms` as a fraction of the copy bandwidth."""
        return self.weight_bytes / (step_ms / 1e3) / self.copy_bytes_per_s


class WeightsQuality(BaseModel):
    """The llama.cpp engine serving one weight type against the float torch target, on held-out prompts."""

    agreement: float = Field(description="teacher-forced share of positions whose argmax equals the float target's")
    perplexity_delta: float = Field(description="relative perplexity change on the prompts' texts (+0.02: 2 % higher)")
    greedy_match: float = Field(description="share of prompts whose greedy answer equals the float target's")
    prompts: int
    greedy_tokens: int
    meets_floor: bool = Field(description="agreement ≥ the policy's quality floor (quantization.min_agreement)")


class LlamaWeights(BaseModel):
    """One weight type on the llama.cpp engine: speed beside llama.cpp's own generation of the file,
    pass costs, batch scaling, and quality against the float target."""

    weights: GgufWeights
    weight_types: str = Field(description="llama.cpp's description of the weights (architecture, size, type)")
    file_mb: float
    engine_tokens_per_s: float = Field(description="specroute's step loop on these weights, batch 1")
    peer_tokens_per_s: float = Field(description="llama.cpp's own generation of the file as shipped, interleaved")
    ratio: float = Field(description="engine tokens/s over the peer's")
    identical_prompts: int = Field(description="requests whose greedy tokens equal the peer's")
    pass_cost: dict[int, float] = Field(description="v(1, k): a batch-1 pass verifying k drafts over a 1-token pass")
    batches: list[BatchPoint] = Field(description="the engine's loop on these weights by batch size")
    variance: str | None = Field(
        description="where the start-up probe found a row's logits depend on a pass's width or batch (None: nowhere; "
        "then speculation on these weights is exact to them, else refused)"
    )
    quality: WeightsQuality


class LlamaCppPlain(BaseModel):
    """The step loop on the llama.cpp engine, per weight type, against llama.cpp's own generation of the file."""

    unavailable: str | None = Field(None, description="why this section was not measured (then nothing else is set)")
    requests: int = 0
    torch_tokens_per_s: float = Field(
        0.0, description="specroute's step loop on the torch engine, batch 1 (interleaved with the first weights)"
    )
    torch_peer_tokens_per_s: float = Field(0.0, description="the peer in the same rounds as the torch loop")
    weights: list[LlamaWeights] = Field(default_factory=list)


class BenchPlainReport(BaseModel):
    machine: MachineInfo
    model: dict[str, object]
    comparison: GenerateComparison
    batches: list[BatchPoint]
    bandwidth: BandwidthUse
    llamacpp: LlamaCppPlain | None = None


def run_bench_plain(config: BenchPlainConfig) -> BenchPlainReport:
    loaded = load_target(config)
    engine = PlainEngine(loaded)
    requests = [
        GenerationRequest(messages=[ChatMessage(role="user", content=p)], max_tokens=config.max_tokens, ignore_eos=True)
        for p in BENCH_PROMPTS
    ]
    llama_runs = len(config.gguf_weights) * (config.rounds * len(requests) + len(config.batch_sizes))
    total = 2 * config.rounds * len(requests) + len(config.batch_sizes) + 1 + llama_runs
    with tqdm(total=total, desc="bench plain", unit="run", leave=False) as bar:
        _warm_up(engine, loaded, requests[0])
        copy_bandwidth = measure_copy_bandwidth(device=config.device)
        matvec_bandwidth = measure_matvec_bandwidth(loaded.model.get_output_embeddings())
        bar.update()
        comparison = _compare_with_generate(engine, loaded, requests, config.rounds, bar)
        batches = [_batch_point(engine, requests, size, bar) for size in config.batch_sizes]
        steps = _decode_steps(engine, loaded, requests[0], config.rounds)
        llama = _llamacpp_section(loaded, requests, config, bar)
    decode_step_s = steps[loaded.info.linear_kernels or "as loaded"]
    achieved = loaded.info.weight_bytes / decode_step_s
    return BenchPlainReport(
        machine=machine_info(),
        model=loaded.info.as_dict(),
        comparison=comparison,
        batches=batches,
        bandwidth=BandwidthUse(
            weight_bytes=loaded.info.weight_bytes,
            decode_step_ms=decode_step_s * 1e3,
            achieved_bytes_per_s=achieved,
            copy_bytes_per_s=copy_bandwidth,
            fraction=achieved / copy_bandwidth,
            matvec_bytes_per_s=matvec_bandwidth,
            matvec_fraction=achieved / matvec_bandwidth,
            linear_kernels=loaded.info.linear_kernels,
            kernels_reason=None if loaded.kernels is None else loaded.kernels.reason(),
            packed_decode_step_ms=steps["packed"] * 1e3 if "packed" in steps else None,
            torch_decode_step_ms=steps["torch"] * 1e3 if "torch" in steps else None,
        ),
        llamacpp=llama,
    )


def _llamacpp_section(
    loaded: LoadedModel, requests: list[GenerationRequest], config: BenchPlainConfig, bar: tqdm
) -> LlamaCppPlain:
    """Per weight type: batch-1 tokens/s of the llama.cpp engine's loop against llama.cpp's own
    generation of the shipped file (the torch loop beside them in the first type's rounds; who goes
    first rotates), v(1, k), the loop by batch size and the quality against the float target."""
    reason = llama_unavailable() or (None if loaded.gguf else f"{loaded.info.name} was not loaded from a GGUF file")
    if reason is not None or config.quantize is not None:
        return LlamaCppPlain(unavailable=reason or "the torch target is quantized here (--quantize)")
    threads = torch.get_num_threads()
    peer, reference = LlamaCppPeer(gguf_file(loaded), threads), Scheduler(loaded)
    truth = quality_reference(loaded, config.quality_prompts, config.quality_tokens)
    torch_rates: dict[str, float] = {}
    measured = []
    widest = max(config.batch_sizes)
    for index, weights in enumerate(config.gguf_weights):
        engine = Scheduler(
            loaded,
            LoopSettings(
                engine="llamacpp",
                gguf_weights=weights,
                max_batch=widest,
                kv_cache_tokens=widest * 1024,
                prefix_caching=False,
            ),
        )
        runs: dict[str, Callable[[GenerationRequest], list[int]]] = {
            "engine": lambda r, engine=engine: engine.generate([r])[0].token_ids,
            "peer": lambda r, engine=engine: peer.generate(engine.plain.encode(r), r.max_tokens),  # ignore_eos
        }
        if index == 0:
            runs["torch"] = lambda r: reference.generate([r])[0].token_ids
        rates, same = _interleaved(runs, requests, config.rounds, bar)
        torch_rates = torch_rates or {"torch": rates["torch"], "peer": rates["peer"]}
        measured.append(_weights_point(loaded, weights, engine, rates, same, truth, requests, config, bar))
        engine.close()  # its context holds the widest batch's cache: freed before the next type's
    return LlamaCppPlain(
        requests=config.rounds * len(requests),
        torch_tokens_per_s=torch_rates["torch"],
        torch_peer_tokens_per_s=torch_rates["peer"],
        weights=measured,
    )


def _weights_point(
    loaded: LoadedModel,
    weights: GgufWeights,
    engine: Scheduler,
    rates: dict[str, float],
    same: int,
    truth: Reference,
    requests: list[GenerationRequest],
    config: BenchPlainConfig,
    bar: tqdm,
) -> LlamaWeights:
    """The rest of one weight type's entry: its pass costs, batch scaling and quality."""
    path = gguf_file(loaded, weights)
    quality = measure_gguf_quality(truth, loaded, weights)
    costs = measure_llamacpp_step_times(path, 1, [1, *(k + 1 for k in PASS_COST_DRAFTS)], torch.get_num_threads())
    return LlamaWeights(
        weights=weights,
        weight_types=gguf_weight_types(path),
        file_mb=path.stat().st_size / 1e6,
        engine_tokens_per_s=rates["engine"],
        peer_tokens_per_s=rates["peer"],
        ratio=rates["engine"] / rates["peer"],
        identical_prompts=same,
        pass_cost={width - 1: seconds / costs[1] for width, seconds in costs.items() if width > 1},
        batches=[_batch_point(engine, requests, size, bar) for size in config.batch_sizes],
        variance=pass_variance(str(path), torch.get_num_threads()),
        quality=WeightsQuality(
            agreement=quality.agreement,
            perplexity_delta=quality.perplexity_delta,
            greedy_match=quality.greedy_match,
            prompts=quality.prompts,
            greedy_tokens=quality.greedy_tokens,
            meets_floor=quality.agreement >= config.min_agreement,
        ),
    )


def _interleaved(
    runs: dict[str, Callable[[GenerationRequest], list[int]]],
    requests: list[GenerationRequest],
    rounds: int,
    bar: tqdm,
) -> tuple[dict[str, float], int]:
    """Tokens/s of each run over `rounds` × `requests` (every request runs to max_tokens), who goes
    first rotating, after an untimed short call each; and how often the engine's tokens equal the peer's."""
    for run in runs.values():  # untimed: first passes set up buffers and kernels
        run(requests[0].model_copy(update={"max_tokens": 4}))
    seconds, same, names = dict.fromkeys(runs, 0.0), 0, list(runs)
    for index in range(rounds * len(requests)):
        request, turn = requests[index % len(requests)], index % len(names)
        tokens = {}
        for name in names[turn:] + names[:turn]:
            tokens[name], elapsed = _timed(functools.partial(runs[name], request))
            seconds[name] += elapsed
        same += tokens["engine"] == tokens["peer"]
        bar.update()
    count = rounds * sum(r.max_tokens for r in requests)
    return {name: count / s for name, s in seconds.items()}, same


def _warm_up(engine: PlainEngine, loaded: LoadedModel, request: GenerationRequest) -> None:
    """First calls pay for allocator growth and kernel selection; neither engine should be charged."""
    short = request.model_copy(update={"max_tokens": 4})
    engine.generate([short])
    _hf_generate(loaded, engine.encode(short), 4)


def _compare_with_generate(
    engine: PlainEngine, loaded: LoadedModel, requests: list[GenerationRequest], rounds: int, bar: tqdm
) -> GenerateComparison:
    """Batch-1 tokens/s of both engines; which runs first alternates each round to cancel drift."""
    ours_s = theirs_s = 0.0
    identical = True
    for round_index in range(rounds):
        for request in requests:
            ours, theirs, same = _time_pair(engine, loaded, request, ours_first=round_index % 2 == 0)
            ours_s, theirs_s, identical = ours_s + ours, theirs_s + theirs, identical and same
            bar.update(2)
    tokens = rounds * sum(r.max_tokens for r in requests)  # ignore_eos: every request runs to max_tokens
    return GenerateComparison(
        requests=rounds * len(requests),
        tokens_per_request=requests[0].max_tokens,
        specroute_tokens_per_s=tokens / ours_s,
        transformers_tokens_per_s=tokens / theirs_s,
        ratio=theirs_s / ours_s,
        identical_tokens=identical,
    )


def _decode_steps(
    engine: PlainEngine, loaded: LoadedModel, request: GenerationRequest, rounds: int
) -> dict[str, float]:
    """Mean batch-1 decode step (s) as the engine runs it, by linear kernels: on a CPU with
    oneDNN both ("packed", "torch") alternate, a warm-up round first, and the model is left with the
    kernels it was loaded with; elsewhere the one step ("as loaded")."""
    chosen = loaded.info.linear_kernels
    if chosen is None or not packing_available():
        engine.generate([request])
        return {chosen or "as loaded": sum(engine.generate([request])[0].tpot_s for _ in range(rounds)) / rounds}
    kernels = (chosen, "torch" if chosen == "packed" else "packed")
    seconds = dict.fromkeys(kernels, 0.0)
    try:
        for round_index in range(rounds + 1):
            for kernel in kernels if round_index % 2 == 0 else kernels[::-1]:
                apply_linear_kernels(loaded.model, kernel)  # type: ignore[arg-type]
                step = engine.generate([request])[0].tpot_s
                if round_index:  # the first round warms both (a first packed call packs its layer)
                    seconds[kernel] += step
    finally:
        apply_linear_kernels(loaded.model, chosen)  # type: ignore[arg-type]
    return {kernel: total / rounds for kernel, total in seconds.items()}


def _time_pair(
    engine: PlainEngine, loaded: LoadedModel, request: GenerationRequest, ours_first: bool
) -> tuple[float, float, bool]:
    """Seconds for our engine and for `model.generate` on one request, and whether tokens match."""

    def ours() -> list[int]:
        return engine.generate([request])[0].token_ids

    def theirs() -> list[int]:
        # Both sides go from the request to tokens, chat templating included.
        return _hf_generate(loaded, engine.encode(request), request.max_tokens)

    timed = {run: _timed(run) for run in ((ours, theirs) if ours_first else (theirs, ours))}
    (our_tokens, our_s), (their_tokens, their_s) = timed[ours], timed[theirs]
    return our_s, their_s, our_tokens == their_tokens


def _timed(run: Callable[[], list[int]]) -> tuple[list[int], float]:
    start = time.perf_counter()
    tokens = run()
    return tokens, time.perf_counter() - start


def _batch_point(
    engine: PlainEngine | Scheduler, requests: list[GenerationRequest], size: int, bar: tqdm
) -> BatchPoint:
    batch = [requests[i % len(requests)] for i in range(size)]
    start = time.perf_counter()
    results = engine.generate(batch)
    elapsed = time.perf_counter() - start
    bar.update()
    return BatchPoint(
        batch_size=size,
        tokens_per_s=sum(r.completion_tokens for r in results) / elapsed,
        step_ms=results[0].tpot_s * 1e3,
    )


def _hf_generate(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids], device=loaded.model.device)
    # eos_token_id=[] keeps generating past EOS, as ignore_eos does on our side.
    config = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, eos_token_id=[], pad_token_id=loaded.tokenizer.pad_token_id
    )
    output = loaded.model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
    )
    return output[0, len(prompt_ids) :].tolist()


def render_report(report: BenchPlainReport) -> str:
    c, bw, m = report.comparison, report.bandwidth, report.model
    base = report.batches[0].tokens_per_s
    lines = [
        f"specroute bench plain — {m['name']} ({m['dtype']}, {m['device']}) on {report.machine.cpu}, "
        f"{report.machine.torch_threads} torch threads",
        "",
        f"batch 1, {c.requests} requests × {c.tokens_per_request} tokens, interleaved with transformers:",
        f"  specroute plain engine      {c.specroute_tokens_per_s:8.2f} tok/s",
        f"  transformers generate       {c.transformers_tokens_per_s:8.2f} tok/s",
        f"  ratio                       {c.ratio:8.3f}×",
        f"  greedy tokens identical     {'yes' if c.identical_tokens else 'NO'}",
        "",
        "batch scaling (plain engine):",
        "  batch      tok/s   step ms   × batch-1 tok/s",
    ]
    lines += [
        f"  {p.batch_size:5d} {p.tokens_per_s:10.1f} {p.step_ms:9.1f} {p.tokens_per_s / base:10.2f}×"
        for p in report.batches
    ]
    lines += [
        "",
        "physical limit (batch-1 decode step):",
        f"  {bw.weight_bytes / 1e6:.1f} MB of weights × {1e3 / bw.decode_step_ms:.1f} steps/s = "
        f"{bw.achieved_bytes_per_s / 1e9:.2f} GB/s achieved",
        f"  memory copy bandwidth measured now: {bw.copy_bytes_per_s / 1e9:.2f} GB/s  →  {bw.fraction:.1%} of it",
        f"  one matrix-vector product through the LM head: {bw.matvec_bytes_per_s / 1e9:.2f} GB/s  →  "
        f"{bw.matvec_fraction:.1%} of that kernel ceiling",
    ]
    if bw.packed_decode_step_ms is not None and bw.torch_decode_step_ms is not None:
        packed, plain = bw.packed_decode_step_ms, bw.torch_decode_step_ms
        lines += [
            f"  step with packed linear layers {packed:7.1f} ms  →  {bw.fraction_at(packed):.1%} of copy bandwidth",
            f"  step with torch's own linear   {plain:7.1f} ms  →  {bw.fraction_at(plain):.1%}  "
            f"(packed: {plain / packed:.2f}× as fast)",
        ]
    if bw.kernels_reason is not None:
        lines += [f"  the load chose {bw.kernels_reason}"]
    return "\n".join(lines + _llamacpp_lines(report.llamacpp))


def _llamacpp_lines(llama: LlamaCppPlain | None) -> list[str]:
    if llama is None:
        return []
    if llama.unavailable is not None:
        return ["", f"llama.cpp engine: not measured ({llama.unavailable})"]
    first = llama.weights[0]
    lines = [
        "",
        f"llama.cpp engine, batch 1, {llama.requests} requests per weight type, each interleaved with llama.cpp's "
        "own generation of the file as shipped:",
        "  weights  llama.cpp says                   MB   tok/s  peer tok/s  × peer  = peer   "
        + " ".join(f"v(1,{k})" for k in PASS_COST_DRAFTS),
    ]
    for w in llama.weights:
        costs = " ".join(f"{w.pass_cost.get(k, float('nan')):6.2f}" for k in PASS_COST_DRAFTS)
        lines.append(
            f"  {w.weights:7s}  {w.weight_types:28s} {w.file_mb:6.1f} {w.engine_tokens_per_s:7.1f} "
            f"{w.peer_tokens_per_s:11.1f} {w.ratio:6.2f}× {w.identical_prompts:3d}/{llama.requests:<3d} {costs}"
        )
    lines += [
        f"  {w.weights}: passes NOT invariant, speculation refused — {w.variance}"
        for w in llama.weights
        if w.variance is not None
    ]
    lines += [
        f"  specroute loop, torch engine (float target), in the first rounds: {llama.torch_tokens_per_s:.1f} tok/s "
        f"({llama.torch_tokens_per_s / llama.torch_peer_tokens_per_s:.2f}× the peer)",
        "  = peer: requests whose greedy tokens equal the peer's (its defaults: F16 cache, no flash attention; the "
        "engine: Q8_0 cache, flash attention)",
        "",
        f"quality against the float target ({first.quality.prompts} held-out prompts, {first.quality.greedy_tokens} "
        "greedy tokens each):",
        "  weights  agreement  perplexity Δ  greedy identical  floor",
    ]
    lines += [
        f"  {w.weights:7s} {w.quality.agreement:9.2%} {w.quality.perplexity_delta:+12.2%} "
        f"{w.quality.greedy_match:16.0%}  {'meets' if w.quality.meets_floor else 'UNDER'}"
        for w in llama.weights
    ]
    base = first.batches[0].tokens_per_s if first.batches else 0.0
    lines += [
        "",
        f"batch scaling (step loop, llama.cpp engine; × the {first.weights} weights' batch-1 tok/s):",
        "  weights  " + "".join(f"{f'batch {p.batch_size}':>18s}" for p in first.batches),
    ]
    lines += [
        f"  {w.weights:7s}  " + "".join(f"{p.tokens_per_s:9.1f} ({p.tokens_per_s / base:4.2f}×)" for p in w.batches)
        for w in llama.weights
    ]
    return lines
