"""The engines a target's passes can run on, named once (`backends.engines` implements them; the
CLI, the settings schemas and, through them, the policy read the names here, free of torch)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from .drafters import SERVED_KINDS, DrafterKind

EngineName = Literal["torch", "llamacpp"]
ENGINES: tuple[EngineName, ...] = ("torch", "llamacpp")
# What a service's settings may say: an engine, or "auto" — the engine this machine's profiles
# predict faster for a lone request among those whose weights meet the policy's quality floor
# (policies.serving_dtype.choose_engine), decided before any replica starts.
EngineChoice = Literal["auto", "torch", "llamacpp"]
ENGINE_CHOICES: tuple[EngineChoice, ...] = ("auto", *ENGINES)
ENGINE_SUMMARIES: dict[EngineName, str] = {
    "torch": "transformers over specroute's paged KV cache: the exact float reference, every drafter",
    "llamacpp": "a .gguf model on llama.cpp (llama-cpp-python), its own weight types and kernels; drafters "
    "that need only tokens",
}

# The weights the llama.cpp engine serves: the GGUF file's own ("file"), or the file requantized by
# llama.cpp (`llama_model_quantize`) to one type. Which is fastest differs by CPU and by batch (a
# type with a repacked matrix-matrix kernel batches and verifies cheaply), and each is its own
# numerical model whose quality against the float target is measured, never assumed.
GgufWeights = Literal["file", "Q4_0", "IQ4_NL", "Q5_0", "Q8_0", "F16", "BF16"]
GGUF_WEIGHTS: tuple[GgufWeights, ...] = get_args(GgufWeights)

# The llama.cpp engine's quantized backend: the file requantized to a faster type than the plain and
# speculative backends serve (on a CPU where that type's kernels are faster), admitted like torch's
# quantized backend by its measured quality against the float target. Q8_0 by default: the type that
# stays closest to the float target whatever the source file holds.
DEFAULT_QUANTIZED_WEIGHTS: GgufWeights = "Q8_0"


def gguf_method(weights: GgufWeights) -> str:
    """The quantization method name a profile and the policy give the llama.cpp engine serving
    `weights` (a quantized backend is named by its method, as torch's int4-weight-only is)."""
    return f"llamacpp-{weights}"


def default_drafters(engine: EngineName) -> list[DrafterKind]:
    """The drafters a service or profile loads unless told otherwise: on torch every served kind;
    on llama.cpp prompt lookup only — a draft model runs on torch, whose pass of a model as small as
    the target costs more than llama.cpp's pass of the target itself (`--drafters ngram,model`
    measures it anyway)."""
    return list(SERVED_KINDS) if engine == "torch" else ["ngram"]


def with_engine_drafters(data: Any) -> Any:
    """Settings' raw fields (a `mode="before"` validator of the service's and the profiler's
    settings) with the named engine's default drafters where none are named; torch's are the
    fields' own default, and an engine still to be decided (auto) gets its own once decided."""
    engine = data.get("engine") if isinstance(data, dict) else None
    if engine in ENGINES and engine != "torch" and "drafters" not in data:
        return {**data, "drafters": default_drafters(engine)}
    return data
