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


GGUF_METHOD_PREFIX = "llamacpp-"


def gguf_method(weights: GgufWeights) -> str:
    """The quantization method name a profile and the policy give the llama.cpp engine serving
    `weights` (a quantized backend is named by its method, as torch's int4-weight-only is)."""
    return f"{GGUF_METHOD_PREFIX}{weights}"


def default_drafters(engine: EngineName) -> list[DrafterKind]:
    """The drafters a service or profile loads unless told otherwise: on torch every served kind;
    on llama.cpp prompt lookup only — a draft model runs on torch, whose pass of a model as small as
    the target costs more than llama.cpp's pass of the target itself (`--drafters ngram,model`
    measures it anyway)."""
    return list(SERVED_KINDS) if engine == "torch" else ["ngram"]


# The drafters the quantized backend may speculate with: those that read only tokens, so they serve
# a quantized target as they serve the float one (the hidden-state drafters were trained on the
# float target's features).
QUANTIZED_DRAFTER_KINDS: tuple[DrafterKind, ...] = ("ngram", "model")


def default_quantized_drafters(engine: EngineName) -> list[DrafterKind]:
    """The drafters the quantized backend speculates with unless told otherwise (quantization stacked
    with speculation, exact to the quantized model). On llama.cpp prompt lookup: the requantized
    type's passes are probed width-invariant where it runs, so its speculative tokens are its plain
    ones. On torch none: the weight-only int kernels give a token other logits at other pass widths
    (greedy prompt lookup at k = 4 equalled plain decoding on 13 and 11 of 14 held-out prompts with
    int4 and int8, 2-core AMD EPYC), and the width-invariant passes that make it exact (14 of 14)
    halved int4's plain decoding there (15.3 → 7.5 tokens/s, one thread): `quantized_drafters:
    [ngram]` turns it on where a machine's kernels make it pay."""
    return ["ngram"] if engine == "llamacpp" else []


def quantized_drafters(engine: EngineName, given: list[DrafterKind] | None) -> list[DrafterKind]:
    """The quantized backend's drafters: those `given`, else the engine's default."""
    return default_quantized_drafters(engine) if given is None else list(given)


def check_quantized_drafters(given: list[DrafterKind] | None, drafters: list[DrafterKind]) -> None:
    """Refuse quantized drafters that need more than tokens or are not among the loaded `drafters`
    (the policy prices a drafter's steps by its profile)."""
    for kind in given or []:
        if kind not in QUANTIZED_DRAFTER_KINDS or kind not in drafters:
            raise ValueError(
                f"quantized_drafters: {kind} cannot draft for the quantized backend: name drafters that read only "
                f"tokens ({', '.join(QUANTIZED_DRAFTER_KINDS)}) and are among drafters ({', '.join(drafters)})"
            )


def with_engine_drafters(data: Any) -> Any:
    """Settings' raw fields (a `mode="before"` validator of the service's and the profiler's
    settings) with the named engine's default drafters where none are named; torch's are the
    fields' own default, and an engine still to be decided (auto) gets its own once decided."""
    engine = data.get("engine") if isinstance(data, dict) else None
    if engine in ENGINES and engine != "torch" and "drafters" not in data:
        return {**data, "drafters": default_drafters(engine)}
    return data
