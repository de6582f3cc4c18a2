"""The quantized target: the same model with int8 or int4 weights, and how far its outputs drift
from the full-precision target.

Methods (`QUANT_METHODS`; the backend serves one, the profile measures each it is asked for):
- `int8-weight-only` and `int4-weight-only` (`auto`, the default, picks one: int4 for weights on
  a group-32 4-bit grid, else int8): weights quantized, activations kept
  float, computed by torch's fused CPU kernels (`backends.weight_only`). Decode at small batch is
  bound by the bytes of weights read, which these cut 4× and 8× from float32. int4 uses groups of
  32 with a scale and an offset: the layout of GGUF's Q4_1 blocks, in which the embedded default
  ships, so it holds that model's weights nearly as they are.
- `smoothquant`, `smoothquant-fp32-down`, `dynamic`: W8A8 through torch's dynamic quantization
  (fbgemm; the `torch.ao.quantization` path, which torch deprecates): activations are quantized
  per batch too. Raw `dynamic` agreed with the float target on under half the tokens here: a few
  huge activation channels crush one scale per tensor. So these first *smooth* (SmoothQuant,
  Xiao et al. 2023): per input channel j a factor s_j = max|x_j|^a / max|w_j|^(1-a), from
  activations seen on calibration prompts, divides the activation and multiplies the weight,
  folded exactly into the preceding RMSNorm weight (q/k/v, gate/up) or the up projection's rows
  (down). `smoothquant-fp32-down` keeps the MLP's down projection in float.

Every method leaves the embedding table and the LM head in float (the head shares its matrix with
the embedding table and decides the argmax).

Quality is measured (`measure_quality`; the float target's side is read once, `reference_side`)
on prompts the calibration did not see: teacher-forced agreement (both models read the same text —
prompts and the float target's own greedy answers — and we count positions where their argmax
agrees, so one early divergence does not turn every later token into a disagreement), the
perplexity delta on the prompt texts, and free-running greedy agreement (the share of prompts whose
first greedy tokens are all identical).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from policies.quantization import QUANT_CHOICES, QUANT_METHODS, UNCALIBRATED, WEIGHT_ONLY, QuantChoice, QuantMethod

from .embedded import specroute_home
from .errors import ModelLoadError
from .generation import GenerationRequest
from .models import LoadedModel
from .plain import PlainEngine
from .scheduler import LoopSettings
from .weight_only import check_weight_only, on_int4_grid, replace_linears

SMOOTHING = 0.8  # the migration strength a: 0.5 / 0.8 / 0.9 measured here, 0.8 agreed best
_MLP_IN, _DOWN = ("gate_proj", "up_proj"), "down_proj"
_ATTN_IN = ("q_proj", "k_proj", "v_proj")
_HEAD = "lm_head"


Settings = TypeVar("Settings", bound=LoopSettings)


def drafting_settings(settings: Settings, drafting: bool) -> Settings:
    """A torch quantized loop's settings: torch's int kernels vary with a pass's width, so a loop
    that speculates runs every pass tiled (width-invariant) to keep verification exact; served
    and profiled alike."""
    return settings.model_copy(update={"width_invariant": "on"}) if drafting else settings


def resolve_method(loaded: LoadedModel, choice: str) -> QuantMethod:
    """The method a choice names: itself, or for "auto" the weight-only method the weights fit."""
    if choice != "auto":
        if choice not in QUANT_METHODS:
            raise ModelLoadError(f"unknown quantization method {choice!r} (choose from {', '.join(QUANT_CHOICES)})")
        return choice  # type: ignore[return-value]
    return "int4-weight-only" if on_int4_grid(_linears(loaded.model)) else "int8-weight-only"


def quantize(
    loaded: LoadedModel,
    calibration: Sequence[list[int]] = (),
    method: QuantChoice = "auto",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """A copy of `loaded` with quantized linear layers (the original is left untouched).
    `calibration`: token sequences whose activations set the smoothing factors (the W8A8 methods
    only; weight-only methods read no activations). With `cache_dir`, those activation maxima (a
    pass over every calibration token, the slow part) are kept there, keyed by the weights and the
    calibration tokens, so the next start of the same model reuses them."""
    method = resolve_method(loaded, method)
    check_method(loaded, method, calibration)
    model = copy.deepcopy(loaded.model)
    if method in WEIGHT_ONLY:
        replace_linears(model, method, skip={_HEAD})
        model.eval()
        info = dataclasses.replace(loaded.info, dtype=method, weight_bytes=weight_bytes(model))
        return LoadedModel(model=model, tokenizer=loaded.tokenizer, info=info)
    if method != "dynamic":
        _smooth(model, _cached_maxima(loaded, model, calibration, cache_dir), SMOOTHING)
    skip = {_HEAD} | ({_DOWN} if method == "smoothquant-fp32-down" else set())
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    spec = {
        name: qconfig
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in skip
    }
    torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, inplace=True)
    model.eval()
    info = dataclasses.replace(loaded.info, dtype=f"int8-{method}", weight_bytes=weight_bytes(model))
    return LoadedModel(model=model, tokenizer=loaded.tokenizer, info=info)


def check_method(loaded: LoadedModel, method: str, calibration: Sequence[list[int]] = ()) -> None:
    """Refuse, before any weight is touched, a method this model, device or dtype cannot run."""
    if method not in QUANT_METHODS:
        raise ModelLoadError(f"unknown quantization method {method!r} (choose from {', '.join(QUANT_METHODS)})")
    if loaded.info.dtype != "float32":
        raise ModelLoadError(f"quantization starts from float32 weights (got {loaded.info.dtype})")
    if method in WEIGHT_ONLY:
        check_weight_only(method, loaded.info.device, _linears(loaded.model))  # type: ignore[arg-type]
        return
    if loaded.info.device != "cpu":
        raise ModelLoadError(
            f"{method} runs torch's CPU dynamic quantization only: serve the quantized backend on a CPU"
        )
    if method != "dynamic" and not calibration:
        raise ModelLoadError("smoothing needs calibration prompts (none given)")
    layers = getattr(getattr(loaded.model, "model", None), "layers", None)
    if method != "dynamic" and not (layers and all(_llama_like(layer) for layer in layers)):
        raise ModelLoadError(
            "smoothing folds factors into Llama-style blocks (input/post-attention RMSNorm, q/k/v, "
            "gate/up/down projections); this model has another layout: use int8-weight-only or dynamic"
        )


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The layers a method quantizes: every linear one but the LM head."""
    return {
        name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] != _HEAD
    }


def needs_calibration(method: str) -> bool:
    """Whether the method reads calibration activations (the smoothed W8A8 ones)."""
    return method not in UNCALIBRATED


def _llama_like(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (
        hasattr(layer, "input_layernorm")
        and hasattr(layer, "post_attention_layernorm")
        and all(isinstance(getattr(attn, n, None), nn.Linear) for n in _ATTN_IN)
        and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in (*_MLP_IN, _DOWN))
    )


def calibration_cache() -> Path:
    """Where smoothing's calibration statistics are kept between runs (under SPECROUTE_HOME)."""
    return specroute_home() / "cache"


def _cached_maxima(
    loaded: LoadedModel, model: nn.Module, calibration: Sequence[list[int]], cache_dir: Path | None
) -> dict[str, torch.Tensor]:
    if cache_dir is None:
        return _activation_maxima(model, calibration)
    key = hashlib.sha256()
    key.update(loaded.fingerprint.encode())
    key.update(json.dumps([loaded.info.dtype, list(map(list, calibration))]).encode())
    path = cache_dir / f"activation-maxima-{key.hexdigest()[:24]}.safetensors"
    if path.is_file():
        return load_file(str(path))
    maxima = _activation_maxima(model, calibration)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(".tmp")
    save_file({name: t.contiguous() for name, t in maxima.items()}, str(staged))
    staged.replace(path)  # replicas starting together never read half a file
    return maxima


@torch.inference_mode()
def _activation_maxima(model: nn.Module, calibration: Sequence[list[int]]) -> dict[str, torch.Tensor]:
    """max |x_j| per input channel of every layer's q, gate and down projections."""
    maxima: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(0).float()
            maxima[name] = torch.maximum(maxima[name], x) if name in maxima else x

        return hook

    hooks = [
        module.register_forward_pre_hook(record(name))
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in ("q_proj", "gate_proj", _DOWN)
    ]
    try:
        for ids in calibration:
            model(input_ids=torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


@torch.no_grad()
def _smooth(model: nn.Module, maxima: dict[str, torch.Tensor], strength: float) -> None:
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        _fold(
            maxima[prefix + "self_attn.q_proj"],
            layer.input_layernorm.weight,
            [getattr(attn, n) for n in _ATTN_IN],
            strength,
        )
        _fold(
            maxima[prefix + "mlp.gate_proj"],
            layer.post_attention_layernorm.weight,
            [getattr(mlp, n) for n in _MLP_IN],
            strength,
        )
        # down's input is silu(gate) * up: scaling up's output rows scales that input channel-wise.
        _fold(maxima[prefix + "mlp.down_proj"], None, [mlp.down_proj], strength, rows=mlp.up_proj.weight)


def _fold(
    act_max: torch.Tensor,
    norm_weight: torch.Tensor | None,
    consumers: list[nn.Linear],
    strength: float,
    rows: torch.Tensor | None = None,
) -> None:
    """Divide the activation by s (via the producer: a norm weight or a projection's rows) and
    multiply the consumers' input columns by s; the float function is unchanged."""
    weight_max = torch.stack([c.weight.abs().amax(0) for c in consumers]).amax(0).clamp(min=1e-5)
    s = (act_max.clamp(min=1e-5) ** strength / weight_max ** (1 - strength)).clamp(min=1e-5)
    s = s.to(consumers[0].weight.dtype)
    if norm_weight is not None:
        norm_weight.div_(s)
    if rows is not None:
        rows.div_(s[:, None])
    for consumer in consumers:
        consumer.weight.mul_(s[None, :])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights resident for a forward pass: float parameters, the weight-only layers'
    packed matrices and scales (buffers), and the packed matrices of dynamic int8 layers."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for module in model.modules():
        if hasattr(module, "_packed_params") and callable(getattr(module, "weight", None)):
            weight = module.weight()  # the int8 matrix behind a quantized linear layer
            total += weight.numel() * weight.element_size()
    return total


def max_weight_error(model: nn.Module) -> float | None:
    """The largest |w − w as the kernel computes it| over the weight-only layers (None: none)."""
    errors = [m.max_weight_error for m in model.modules() if hasattr(m, "max_weight_error")]
    return max(errors) if errors else None


@dataclass(frozen=True)
class Quality:
    agreement: float  # teacher-forced top-1 agreement with the float target
    positions: int  # positions compared
    perplexity: float  # the float target's, on the text set
    perplexity_quantized: float
    greedy_match: float  # share of prompts whose first `greedy_tokens` greedy tokens are identical
    greedy_tokens: int
    prompts: int

    @property
    def perplexity_delta(self) -> float:
        """Relative change: +0.02 means the quantized model's perplexity is 2 % higher."""
        return self.perplexity_quantized / self.perplexity - 1


@dataclass(frozen=True)
class Reference:
    """The full-precision target's side of a quality measurement (`reference_side`): read once,
    compared with any number of quantized models (the W8A8 methods, a profile's several methods,
    the llama.cpp engine's weight types)."""

    requests: tuple[GenerationRequest, ...]
    prompts: tuple[tuple[int, ...], ...]  # each request's prompt tokens
    answers: tuple[tuple[int, ...], ...]  # the reference's greedy answers
    argmax: tuple[torch.Tensor, ...]  # its teacher-forced next-token argmax over prompt + answer
    texts: tuple[tuple[int, ...], ...]  # the perplexity texts' tokens
    perplexity: float


# The logits after every position of a token sequence, (len, V): what a model under test is asked.
Scorer = Callable[[Sequence[int]], torch.Tensor]


def torch_scorer(loaded: LoadedModel) -> Scorer:
    return lambda ids: loaded.model(input_ids=torch.tensor([list(ids)], device=loaded.model.device)).logits[0]


@torch.inference_mode()
def reference_side(reference: LoadedModel, requests: Sequence[GenerationRequest], texts: Sequence[str]) -> Reference:
    """The reference answers every (greedy) request, max_tokens tokens each; its prompt + answer is
    the teacher-forced text; `texts`: raw texts for perplexity."""
    engine = PlainEngine(reference)
    prompts = [engine.encode(r) for r in requests]
    answers = [a.token_ids for a in engine.generate(requests)]
    score = torch_scorer(reference)
    text_ids = [tuple(reference.tokenizer(text).input_ids) for text in texts]
    return Reference(
        requests=tuple(requests),
        prompts=tuple(map(tuple, prompts)),
        answers=tuple(map(tuple, answers)),
        argmax=tuple(score(p + a)[:-1].argmax(-1) for p, a in zip(prompts, answers, strict=True)),
        texts=tuple(text_ids),
        perplexity=perplexity(score, text_ids),
    )


@torch.inference_mode()
def measure_quality(ref: Reference, quantized: LoadedModel) -> Quality:
    """The quantized model answers the reference's requests (its free-running tokens compared with
    the reference's) and reads the reference's prompt + answer (teacher-forced argmax compared)."""
    answers = [tuple(a.token_ids) for a in PlainEngine(quantized).generate(list(ref.requests))]
    return compare_quality(ref, answers, torch_scorer(quantized))


@torch.inference_mode()
def compare_quality(ref: Reference, answers: Sequence[Sequence[int]], score: Scorer) -> Quality:
    """A model's greedy `answers` to the reference's requests and its `score`s of the reference's
    prompt + answer and texts, against the reference's."""
    agree = positions = 0
    for prompt, answer, expected in zip(ref.prompts, ref.answers, ref.argmax, strict=True):
        got = score(prompt + answer)[:-1].argmax(-1).to(expected.device)
        agree += int((got == expected).sum())
        positions += got.numel()
    same = sum(tuple(a) == tuple(b) for a, b in zip(ref.answers, answers, strict=True))
    return Quality(
        agreement=agree / max(positions, 1),
        positions=positions,
        perplexity=ref.perplexity,
        perplexity_quantized=perplexity(score, ref.texts),
        greedy_match=same / max(len(ref.requests), 1),
        greedy_tokens=max((r.max_tokens for r in ref.requests), default=0),
        prompts=len(ref.requests),
    )


@torch.inference_mode()
def perplexity(score: Scorer, texts: Sequence[Sequence[int]]) -> float:
    """exp of the mean next-token negative log-likelihood over every text's tokens."""
    nll, count = 0.0, 0
    for ids in texts:
        if len(ids) < 2:
            continue
        logits = score(ids)[:-1].float()
        target = torch.tensor(list(ids[1:]), device=logits.device)
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        count += len(ids) - 1
    if count == 0:
        raise ValueError("the perplexity text set has no text of two or more tokens")
    return math.exp(nll / count)
