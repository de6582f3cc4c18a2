import numpy as np
import pytest
import torch

from backends.embedded import embedded_gguf_path
from backends.generation import GenerationRequest
from backends.models import ModelLoadError, _one_gguf_reader, load_model, resolve_source
from backends.plain import PlainEngine

pytestmark = pytest.mark.slow


def test_embedded_model_loads_offline_and_knows_paris(loaded):
    engine = PlainEngine(loaded)
    request = GenerationRequest(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20)
    assert "Paris" in engine.generate([request])[0].text


def test_model_info_counts_weights_once_and_in_the_loaded_dtype(loaded):
    info = loaded.info
    assert info.parameters == sum(p.numel() for p in loaded.model.parameters())
    assert 100e6 < info.parameters < 200e6  # SmolLM2-135M, tied embeddings counted once
    assert info.weight_bytes == 4 * info.parameters
    assert (info.layers, info.vocab_size, info.hidden_size) == (30, 49152, 576)
    assert (info.dtype, info.device) == ("float32", "cpu")


def test_bfloat16_load_halves_the_weight_bytes(loaded):
    bf16 = load_model("embedded", dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert bf16.info.weight_bytes == loaded.info.weight_bytes // 2


def test_local_directory_loads_like_the_embedded_alias(loaded):
    _, directory = resolve_source("embedded")
    again = load_model(directory)
    assert again.info.parameters == loaded.info.parameters


def test_gguf_file_loads_and_decodes_like_the_converted_copy(engine):
    from_gguf = PlainEngine(load_model(str(embedded_gguf_path())))
    request = GenerationRequest(prompt="The three primary colors are", max_tokens=12)
    assert from_gguf.generate([request])[0].token_ids == engine.generate([request])[0].token_ids


def test_a_gguf_files_reads_share_one_parse_only_inside_the_load(tmp_path):
    """load_gguf's tokenizer, config and weights each open the file through gguf.GGUFReader: inside
    the load they get one reader of each file, outside it every open parses again."""
    import gguf

    paths = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for path in paths:
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_tensor("w", np.arange(4, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    with _one_gguf_reader():
        first, again, other = gguf.GGUFReader(paths[0]), gguf.GGUFReader(paths[0]), gguf.GGUFReader(paths[1])
        assert first is again and other is not first
        assert list(first.tensors[0].data) == [0, 1, 2, 3]
    assert gguf.GGUFReader(paths[0]) is not first


def test_threads_setting_is_applied():
    before = torch.get_num_threads()
    try:
        load_model("embedded", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("kwargs", "hint"),
    [
        ({"dtype": "float16"}, "unknown dtype 'float16': use one of float32, bfloat16"),
        ({"source": "/nonexistent/model"}, "does not exist"),
        ({"source": "./missing-dir"}, "does not exist"),
        ({"source": "/tmp/nothing-here.gguf"}, "GGUF file '/tmp/nothing-here.gguf' does not exist"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
        ({"threads": 0}, "threads must be at least 1"),
    ],
)
def test_bad_load_arguments_say_what_to_change(kwargs, hint):
    with pytest.raises(ModelLoadError, match=hint.replace(".", r"\.").replace("(", r"\(")):
        load_model(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when no GPU is present")
def test_cuda_without_a_gpu_is_refused_with_a_hint():
    with pytest.raises(ModelLoadError, match="use --device cpu"):
        load_model(device="cuda")


def test_sources_are_classified_without_loading(tmp_path):
    assert resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct") == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolve_source(str(tmp_path)) == ("directory", str(tmp_path))
    assert resolve_source(None)[0] == "embedded"


def test_unreachable_hub_id_fails_with_a_hint():
    with pytest.raises(ModelLoadError, match="local model directory"):
        load_model("no-such-org/no-such-model")
