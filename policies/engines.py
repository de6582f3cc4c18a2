"""The engines a target's passes can run on, named once (`backends.engines` implements them; the
CLI, the settings schemas and, through them, the policy read the names here, free of torch)."""

from __future__ import annotations

from typing import Literal, get_args

EngineName = Literal["torch", "llamacpp"]
ENGINES: tuple[EngineName, ...] = ("torch", "llamacpp")
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
