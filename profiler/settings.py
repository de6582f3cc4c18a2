"""The model flags every measurement shares: which model, in which dtype, on which device, with how
many torch threads."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from backends.errors import ModelLoadError
from backends.models import LoadedModel, load_model
from backends.quantized import needs_calibration, quantize, resolve_method
from policies.engines import ENGINES, EngineName, GgufWeights
from policies.quantization import UNCALIBRATED, QuantChoice


class ModelSettings(BaseModel):
    model: str = Field("embedded", description="'embedded', a local directory, a .gguf file or a HF id")
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's)")


class BenchTarget(ModelSettings):
    """A bench's target: the model, or (`quantize`) the quantized backend's target built from it."""

    quantize: QuantChoice | None = Field(
        None, description="bench the target quantized by this weight-only/int8 method (the quantized backend's)"
    )


class LoopBenchTarget(BenchTarget):
    """A bench of step loops, on either engine."""

    engine: EngineName = Field(
        "torch", description=f"what runs the target's passes in the step loop ({', '.join(ENGINES)})"
    )

    gguf_weights: GgufWeights = Field(
        "file", description="the weights the llamacpp engine serves: the file's own, or the file requantized"
    )

    @model_validator(mode="after")
    def _quantize_is_torchs(self) -> LoopBenchTarget:
        if self.engine != "torch" and self.quantize is not None:
            raise ValueError(
                f"--quantize quantizes the torch engine's weights; the {self.engine} engine runs the GGUF file's own "
                "weight types (--gguf-weights requantizes the file): drop --quantize, or use --engine torch"
            )
        if self.engine != "llamacpp" and self.gguf_weights != "file":
            raise ValueError(
                f"--gguf-weights {self.gguf_weights} requantizes the file the llamacpp engine serves: add "
                "--engine llamacpp, or use --quantize for the torch engine's weights"
            )
        return self


def load_target(config: BenchTarget) -> LoadedModel:
    loaded = load_model(config.model, config.dtype, config.device, config.threads)
    if config.quantize is None:
        return loaded
    method = resolve_method(loaded, config.quantize)
    if needs_calibration(method):
        raise ModelLoadError(
            f"--quantize {method}: benches take a method without calibration ({', '.join(UNCALIBRATED)})"
        )
    return quantize(loaded, method=method)
