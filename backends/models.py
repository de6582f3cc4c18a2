"""One loader for every target model: the embedded default, a Hugging Face id or local
directory, or a `.gguf` file. The cost model needs the bytes of weights streamed per decode
step, so every load also returns a `ModelInfo`."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .attention import use_grouped_attention
from .embedded import EMBEDDED_NAME, embedded_gguf_path, embedded_model_dir, embedded_model_ready
from .errors import ModelLoadError
from .kernels import KernelChoice, choose_linear_kernels

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
EMBEDDED_ALIASES = ("embedded", "default")
_GGUF_LOAD = threading.Lock()  # see _one_gguf_reader


@dataclass(frozen=True)
class ModelInfo:
    name: str
    parameters: int
    weight_bytes: int
    layers: int
    vocab_size: int
    hidden_size: int
    dtype: str
    device: str
    linear_kernels: str | None = None  # "packed" or "torch" on a CPU (`backends/kernels.py`), None elsewhere

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo
    kernels: KernelChoice | None = None  # why a CPU model runs the linear kernels it does
    gguf: Path | None = None  # the GGUF file the weights came from (what the llama.cpp engine serves)

    @cached_property
    def fingerprint(self) -> str:
        """`weights_fingerprint` of this model, computed once."""
        return weights_fingerprint(self.model, self.tokenizer)


def weights_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> str:
    """A hex digest of what a drafter or shipped acceptance depends on: the architecture's sizes, the vocabulary and a
    few weight tensors (rounded to bfloat16 first, so float32 and bfloat16 loads of one model
    agree)."""
    config = model.config
    digest = hashlib.sha256()
    dims = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}
    digest.update(json.dumps(dims, sort_keys=True).encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    decoder = model.model
    for tensor in (
        decoder.embed_tokens.weight,
        decoder.norm.weight,
        decoder.layers[0].self_attn.q_proj.weight,
        decoder.layers[-1].mlp.down_proj.weight,
    ):
        digest.update(tensor.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def load_model(
    source: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    linear_kernels: str | None = None,
) -> LoadedModel:
    """Load `source` ("embedded"/None, a directory, a `.gguf` path or a hub id) for inference; on a
    CPU, `linear_kernels` ("auto", "packed" or "torch"; default SPECROUTE_LINEAR_KERNELS or auto) picks
    the linear layers' kernels (`backends/kernels.py`)."""
    torch_dtype = resolve_dtype(dtype)
    _check_device(device)
    if threads is not None:
        _set_threads(threads)
    kind, location = resolve_source(source)
    if kind == "gguf":
        model, tokenizer = load_gguf(Path(location), torch_dtype)
    else:
        model, tokenizer = _load_pretrained(location, torch_dtype)
    model.to(device).eval()
    kernels = None
    if device == "cpu":  # the decode step's CPU kernels (measured by `specroute bench plain`)
        use_grouped_attention(model)
        kernels = choose_linear_kernels(model, dtype, linear_kernels)
    if tokenizer.pad_token_id is None:
        # Padding positions are masked out, so any id works; EOS is always in the vocabulary.
        tokenizer.pad_token = tokenizer.eos_token
    name = EMBEDDED_NAME if kind == "embedded" else location
    info = describe(model, name, dtype, device)
    if kernels is not None:
        info = replace(info, linear_kernels=kernels.kernel)
    gguf = embedded_gguf_path() if kind == "embedded" else Path(location) if kind == "gguf" else None
    return LoadedModel(model, tokenizer, info, kernels, gguf if gguf is not None and gguf.is_file() else None)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_source(source: str | None) -> tuple[str, str]:
    """Classify a model source as ("embedded" | "gguf" | "directory" | "hub", location)."""
    if source is None or source in EMBEDDED_ALIASES:
        if not embedded_model_ready():
            raise ModelLoadError(
                f"the embedded model is not set up at {embedded_model_dir()}: run `specroute setup` "
                "(or `make model`) once"
            )
        return "embedded", str(embedded_model_dir())
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file '{source}' does not exist: pass the path of an existing .gguf file")
        return "gguf", str(path)
    if path.is_dir():
        return "directory", str(path)
    if _looks_like_path(source):
        raise ModelLoadError(
            f"model path '{source}' does not exist: pass an existing directory, a .gguf file, "
            "a Hugging Face id, or 'embedded'"
        )
    return "hub", source


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file (weights dequantized, tokenizer from the file's metadata)."""
    with _one_gguf_reader():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    # The weights are already dequantized; without this the model refuses save_pretrained
    # and dtype changes as if it were still quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


@contextmanager
def _one_gguf_reader() -> Iterator[None]:
    """transformers reads a GGUF file's header afresh for the tokenizer, the config and the weights,
    each time through `gguf.GGUFReader` (a Python parse of every metadata field: the embedded model's
    49,152-token vocabulary makes each read ~3 s of the ~23 s load here). Within this block the
    three share one reader of each file: the same read-only memory map, so the same tensors. The
    module attribute is swapped for the block, so two loads in one process take turns."""
    import gguf

    with _GGUF_LOAD:
        original, readers = gguf.GGUFReader, {}

        def shared(path, *args, **kwargs):
            key = (str(path), args, tuple(sorted(kwargs.items())))
            if key not in readers:
                readers[key] = original(path, *args, **kwargs)
            return readers[key]

        gguf.GGUFReader = shared
        try:
            yield
        finally:
            gguf.GGUFReader = original


def describe(model: PreTrainedModel, name: str, dtype: str, device: str) -> ModelInfo:
    # model.parameters() yields tied tensors once, so tied embeddings are not counted twice.
    params = list(model.parameters())
    config = model.config
    return ModelInfo(
        name=name,
        parameters=sum(p.numel() for p in params),
        weight_bytes=sum(p.numel() * p.element_size() for p in params),
        layers=config.num_hidden_layers,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        dtype=dtype,
        device=device,
    )


def _load_pretrained(location: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype)
    except OSError as exc:
        raise ModelLoadError(
            f"could not load model '{location}': {exc}. Pass a local model directory, a .gguf file, "
            "or 'embedded' (no model hub may be reachable from this machine)"
        ) from exc
    return model, tokenizer


def _looks_like_path(source: str) -> bool:
    # A hub id is "org/name"; anything absolute, relative-dotted, home-based or deeper is a path.
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ModelLoadError(f"unknown device '{device}': use one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA GPU is available: use --device cpu")


def _set_threads(threads: int) -> None:
    if threads < 1:
        raise ModelLoadError(f"threads must be at least 1 (got {threads})")
    torch.set_num_threads(threads)


def load_tokenizer(source: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a model source alone (no weights): what counting prompt tokens needs."""
    kind, location = resolve_source(source)
    path = Path(location)
    try:
        if kind == "gguf":
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return AutoTokenizer.from_pretrained(location)
    except OSError as exc:
        raise ModelLoadError(f"could not load the tokenizer of '{location}': {exc}") from exc
