"""The int8 target: the same model with int8 weights, and how far its outputs drift from the
full-precision target.

Kernels: torch's dynamic quantization (fbgemm) — int8 weights per output channel, activations
quantized per batch on the fly. Measured here on the embedded model it is ~2× faster than fp32 at
batch 1, but raw it agreed with the float target on under half the tokens: activations of LLMs
carry a few huge channels (worst at the MLP's down projection), and one scale per tensor crushes
the rest. So every method first *smooths* (SmoothQuant, Xiao et al. 2023): per input channel j a
factor s_j = max|x_j|^a / max|w_j|^(1-a), from activations seen on calibration prompts, divides
the activation and multiplies the weight — folded exactly into the preceding RMSNorm weight
(q/k/v, gate/up) or the up projection's rows (down), so the float model computes the same
function and the int8 one sees tamer activations.

Methods: `smoothquant` quantizes every linear layer but the LM head; `smoothquant-fp32-down` keeps
the MLP's down projection in float (slower, closer to the target). Raw `dynamic` is kept for
comparison. The embedding table and the LM head stay float (the head shares its matrix with the
embedding table and decides the argmax).

Quality is measured teacher-forced: both models read the same text (prompts and the float target's
own greedy answers) and we count positions where their argmax agrees, so one early divergence does
not turn every later token into a disagreement; the perplexity delta is on the prompt texts.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .embedded import specroute_home
from .errors import ModelLoadError
from .models import LoadedModel

QuantMethod = Literal["smoothquant", "smoothquant-fp32-down", "dynamic"]
QUANT_METHODS: tuple[str, ...] = ("smoothquant", "smoothquant-fp32-down", "dynamic")
SMOOTHING = 0.8  # the migration strength a: 0.5 / 0.8 / 0.9 measured here, 0.8 agreed best
_MLP_IN, _DOWN = ("gate_proj", "up_proj"), "down_proj"
_ATTN_IN = ("q_proj", "k_proj", "v_proj")


def quantize(
    loaded: LoadedModel,
    calibration: Sequence[list[int]],
    method: QuantMethod = "smoothquant",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """A copy of `loaded` with int8 linear layers (the original is left untouched). `calibration`:
    token sequences whose activations set the smoothing factors. With `cache_dir`, those
    activation maxima (a pass over every calibration token, the slow part) are kept there, keyed
    by the weights and the calibration tokens, so the next start of the same model reuses them."""
    _check(loaded, method, calibration)
    model = copy.deepcopy(loaded.model)
    if method != "dynamic":
        _smooth(model, _cached_maxima(loaded, model, calibration, cache_dir), SMOOTHING)
    skip = {"lm_head"} | ({_DOWN} if method == "smoothquant-fp32-down" else set())
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


def _check(loaded: LoadedModel, method: str, calibration: Sequence[list[int]]) -> None:
    if method not in QUANT_METHODS:
        raise ModelLoadError(f"unknown quantization method {method!r} (choose from {', '.join(QUANT_METHODS)})")
    if loaded.info.device != "cpu":
        raise ModelLoadError("int8 dynamic quantization runs on the CPU only: serve the quantized backend on a CPU")
    if loaded.info.dtype != "float32":
        raise ModelLoadError(f"int8 quantization starts from float32 weights (got {loaded.info.dtype})")
    if method != "dynamic" and not calibration:
        raise ModelLoadError("smoothing needs calibration prompts (none given)")
    layers = getattr(getattr(loaded.model, "model", None), "layers", None)
    if method != "dynamic" and not (layers and all(_llama_like(layer) for layer in layers)):
        raise ModelLoadError(
            "smoothing folds factors into Llama-style blocks (input/post-attention RMSNorm, q/k/v, "
            "gate/up/down projections); this model has another layout: use method 'dynamic'"
        )


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
    """Bytes of weights a forward pass reads: float parameters plus packed int8 matrices."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if hasattr(module, "_packed_params") and callable(getattr(module, "weight", None)):
            weight = module.weight()  # the int8 matrix behind a quantized linear layer
            total += weight.numel() * weight.element_size()
    return total


@dataclass(frozen=True)
class Quality:
    agreement: float  # teacher-forced top-1 agreement with the float target
    positions: int  # positions compared
    perplexity: float  # the float target's, on the text set
    perplexity_int8: float

    @property
    def perplexity_delta(self) -> float:
        """Relative change: +0.02 means the int8 model's perplexity is 2 % higher."""
        return self.perplexity_int8 / self.perplexity - 1


@torch.inference_mode()
def measure_quality(
    reference: LoadedModel, quantized: LoadedModel, continuations: Sequence[list[int]], texts: Sequence[str]
) -> Quality:
    """`continuations`: token sequences (a prompt + the reference's greedy answer) to compare argmax
    over; `texts`: raw texts for perplexity."""
    agree = positions = 0
    for ids in continuations:
        tokens = torch.tensor([ids])
        a = reference.model(input_ids=tokens).logits[0, :-1].argmax(-1)
        b = quantized.model(input_ids=tokens).logits[0, :-1].argmax(-1)
        agree += int((a == b).sum())
        positions += a.numel()
    ppl = perplexity(reference, texts)
    ppl_int8 = perplexity(quantized, texts)
    return Quality(agree / max(positions, 1), positions, ppl, ppl_int8)


@torch.inference_mode()
def perplexity(loaded: LoadedModel, texts: Sequence[str]) -> float:
    """exp of the mean next-token negative log-likelihood over every text's tokens."""
    nll, count = 0.0, 0
    for text in texts:
        ids = loaded.tokenizer(text, return_tensors="pt").input_ids
        if ids.shape[1] < 2:
            continue
        logits = loaded.model(input_ids=ids).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    if count == 0:
        raise ValueError("the perplexity text set has no text of two or more tokens")
    return math.exp(nll / count)
