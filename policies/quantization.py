"""The quantization methods' names: what settings, profiles and the policy may say (the kernels
live in `backends.quantized` and `backends.weight_only`)."""

from __future__ import annotations

from typing import Literal, get_args

# Target dtypes that move half float32's bytes, whose passes are width-invariant by default (their
# kernels' reduction order changes with a pass's width, float32's here does not).
REDUCED_PRECISION: tuple[str, ...] = ("bfloat16", "float16")
WeightOnlyMethod = Literal["int8-weight-only", "int4-weight-only"]
QuantMethod = Literal["int8-weight-only", "int4-weight-only", "smoothquant", "smoothquant-fp32-down", "dynamic"]
QUANT_METHODS: tuple[str, ...] = get_args(QuantMethod)
WEIGHT_ONLY: tuple[str, ...] = get_args(WeightOnlyMethod)
# What settings may name: a method, or "auto" — int4-weight-only when every linear weight already
# sits on a group-32 4-bit grid (a GGUF Q4_0/Q4_1 checkpoint such as the embedded default, which
# int4 then holds as it is), else int8-weight-only (any layout).
QuantChoice = Literal["auto", QuantMethod]
QUANT_CHOICES: tuple[str, ...] = ("auto", *QUANT_METHODS)
# The choices that read no calibration activations (what a bench can quantize on the spot).
UNCALIBRATED: tuple[str, ...] = ("auto", *WEIGHT_ONLY, "dynamic")


def speculation_refusal(method: str) -> str | None:
    """Why the torch quantized backend cannot speculate exactly with `method` (None: it can, with
    width-invariant passes). The W8A8 methods scale each pass's activations by its own maximum, so a
    token's logits depend on every other token of the pass: no pass shape makes verification give
    the tokens plain decoding gives."""
    if method in WEIGHT_ONLY:
        return None
    return (
        f"{method} quantizes activations with one scale per pass, so a drafted token's logits depend on the rest "
        f"of the verify pass and speculation would not be exact: speculate with {' or '.join(WEIGHT_ONLY)}, or set "
        "quantized_drafters: []"
    )
