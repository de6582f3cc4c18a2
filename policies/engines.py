"""The engines a target's passes can run on, named once (`backends.engines` implements them; the
CLI, the settings schemas and, through them, the policy read the names here, free of torch)."""

from __future__ import annotations

from typing import Literal

EngineName = Literal["torch", "llamacpp"]
ENGINES: tuple[EngineName, ...] = ("torch", "llamacpp")
ENGINE_SUMMARIES: dict[EngineName, str] = {
    "torch": "transformers over specroute's paged KV cache: the exact float reference, every drafter",
    "llamacpp": "a .gguf model on llama.cpp (llama-cpp-python), its own weight types and kernels; drafters "
    "that need only tokens",
}
