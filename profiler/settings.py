"""The model flags every measurement shares: which model, in which dtype, on which device, with how
many torch threads."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ModelSettings(BaseModel):
    model: str = Field("embedded", description="'embedded', a local directory, a .gguf file or a HF id")
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's)")
