"""`import_gguf` on GGUF files written on the spot: every supported tensor type dequantizes to
exactly the stored values (Llama's q/k rows back in Hugging Face order), the imported folder
generates what transformers generates on the same weights, and bad files are refused with a
clear error that leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from loraplex import LLM, SamplingParams
from loraplex.errors import ModelLoadError
from loraplex.model import gguf_import
from loraplex.model.gguf_import import import_cached, import_gguf
from loraplex.model.gguf_tensors import SUPPORTED_TYPES
from tests.model.gguf_support import CHAT_TEMPLATE, make_tiny_model, write_gguf

PROMPTS = [[5, 17, 42, 9, 100, 3], [200, 7], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


@pytest.fixture(scope="module")
def tiny_llama():
    return make_tiny_model("llama")


def _loaded(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_each_type_dequantizes_to_the_stored_values(tiny_llama, tmp_path, qtype):
    expected = write_gguf(tiny_llama, tmp_path / "tiny.gguf", qtype)
    imported = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False)
    tensors = _loaded(imported.folder)
    assert sorted(tensors) == sorted(expected)
    for name, values in expected.items():
        assert tensors[name].dtype == torch.bfloat16
        assert torch.equal(tensors[name], values.to(torch.bfloat16)), name
    assert imported.num_params == sum(t.numel() for t in expected.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_imported_model_generates_what_transformers_generates(tmp_path, arch):
    """Weights rounded to bf16 (what the import stores) in transformers, float32 compute, against
    the engine serving the imported folder in float32: the same greedy tokens. A q/k row order
    left as llama.cpp's would change the attention scores and the tokens."""
    hf = make_tiny_model(arch, seed=3)
    write_gguf(hf, tmp_path / "tiny.gguf", "F32")
    imported = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ours = LLM(imported.folder, device="cpu", dtype="float32").generate(
        prompt_token_ids=PROMPTS, sampling_params=params)
    for prompt, output in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                              pad_token_id=0)
        assert output.token_ids == ref[0, len(prompt):].tolist()


def test_config_and_tokenizer(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    write_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0", name="Tiny Test Model")
    imported = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False)
    config = json.loads((imported.folder / "config.json").read_text())
    assert imported.name == config["_name_or_path"] == "Tiny-Test-Model"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 64)
    assert config["tie_word_embeddings"] is False  # the file has output.weight
    tokenizer = AutoTokenizer.from_pretrained(imported.folder)
    ids = tokenizer("the then in 42")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["t", "he", "Ġthe", "n", "Ġ", "in", "Ġ", "4", "2"]
    assert tokenizer.decode(ids) == "the then in 42"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer("<|im_start|>x")["input_ids"][0] == 1  # a special token, not its characters
    assert imported.name == "Tiny-Test-Model"


def test_named_import(tiny_llama, tmp_path):
    write_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q4_0")
    imported = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", name="acme/tiny", show_progress=False)
    assert json.loads((imported.folder / "config.json").read_text())["_name_or_path"] == "acme/tiny"


def test_large_models_are_sharded(tiny_llama, tmp_path, monkeypatch):
    expected = write_gguf(tiny_llama, tmp_path / "tiny.gguf", "F16")
    monkeypatch.setattr(gguf_import, "MAX_SHARD_BYTES", 300_000)
    folder = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False).folder
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (folder / "model.safetensors").exists()
    loaded = {name: t for shard in shards for name, t in load_file(str(folder / shard)).items()}
    assert all(torch.equal(loaded[name], values.to(torch.bfloat16)) for name, values in expected.items())
    LLM(folder, device="cpu", dtype="float32")  # the loader reads the shards


def _assert_nothing_written(tmp_path):
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "good.gguf"]


@pytest.fixture()
def good_bytes(tiny_llama, tmp_path):
    write_gguf(tiny_llama, tmp_path / "good.gguf", "Q4_1")
    return (tmp_path / "good.gguf").read_bytes()


@pytest.mark.parametrize(("case", "message"), [
    ("magic", "is not a GGUF file: it starts with b'GGML'"),
    ("empty", "is not a GGUF file"),
    ("truncated header", "is not a complete GGUF file (truncated or corrupt)"),
    ("truncated tensor", "truncated"),
    ("unknown type id", "has a tensor of unknown GGML type 250"),
])
def test_bad_files_are_refused(good_bytes, tmp_path, case, message):
    if case == "unknown type id":
        data = _with_tensor_type(tmp_path / "good.gguf", 250)
    else:
        data = {"magic": b"GGML" + good_bytes[4:], "empty": b"", "truncated header": good_bytes[:3000],
                "truncated tensor": good_bytes[:-1000]}[case]
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(ModelLoadError, match="bad.gguf") as error:
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out", show_progress=False)
    assert message in error.value.message
    _assert_nothing_written(tmp_path)


def test_unsupported_quantization_is_refused_by_name(tiny_llama, tmp_path):
    write_gguf(tiny_llama, tmp_path / "good.gguf", "Q5_0")
    (tmp_path / "good.gguf").rename(tmp_path / "bad.gguf")
    (tmp_path / "good.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"unsupported tensor type\(s\) Q5_0; the GGUF import supports "
                                             r"F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out", show_progress=False)
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize(("options", "message"), [
    ({"arch": "gpt2"}, "unsupported architecture 'gpt2'; the GGUF import supports llama, qwen2"),
    ({"pre": "falcon"}, "unsupported pre-tokenizer 'falcon'"),
])
def test_unsupported_models_are_refused_by_name(tiny_llama, tmp_path, options, message):
    write_gguf(tiny_llama, tmp_path / "bad.gguf", "F16", **options)
    (tmp_path / "good.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=message):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out", show_progress=False)
    _assert_nothing_written(tmp_path)


def test_a_failure_while_writing_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    write_gguf(tiny_llama, tmp_path / "good.gguf", "Q8_0")
    (tmp_path / "bad.gguf").write_bytes(b"")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_import, "save_file", fail)
    with pytest.raises(OSError, match="No space left"):
        import_gguf(tmp_path / "good.gguf", tmp_path / "out", show_progress=False)
    _assert_nothing_written(tmp_path)


def test_an_existing_folder_is_not_overwritten(tiny_llama, tmp_path):
    write_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(ModelLoadError, match="already exists"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_the_cache_imports_once_and_again_when_the_file_changes(tiny_llama, tmp_path):
    write_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0", name="first")
    folder = import_cached(tmp_path / "tiny.gguf", tmp_path / "cache", show_progress=False)
    assert folder == tmp_path / "cache" / "tiny"
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert import_cached(tmp_path / "tiny.gguf", tmp_path / "cache", show_progress=False) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written
    write_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0", name="second")
    import_cached(tmp_path / "tiny.gguf", tmp_path / "cache", show_progress=False)
    assert json.loads((folder / "config.json").read_text())["_name_or_path"] == "second"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny"]


def test_cli_import_with_progress_and_one_line_errors(tiny_llama, tmp_path):
    write_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q4_1")
    run = [sys.executable, "-m", "loraplex.cli", "model", "import"]
    result = subprocess.run([*run, str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "importing tiny.gguf" in result.stderr and "100%" in result.stderr  # the progress bar
    assert "imported tiny.gguf as 'Tiny-Test-Model'" in result.stdout
    assert str(tmp_path / "out") in result.stdout
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    result = subprocess.run([*run, str(tmp_path / "bad.gguf"), "--out", str(tmp_path / "out2")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"loraplex: error: {tmp_path / 'bad.gguf'} is not a complete GGUF file (truncated or corrupt): "
        + result.stderr.split("(truncated or corrupt): ", 1)[1].strip()]
    assert not (tmp_path / "out2").exists()


def _with_tensor_type(path, type_id: int) -> bytes:
    """The GGUF file's bytes with its first tensor's GGML type id replaced."""
    import gguf

    field = gguf.GGUFReader(path).tensors[0].field
    # a tensor's info: name length, name, number of dimensions, dimensions, type, data offset
    offset = field.offset + sum(part.nbytes for part in field.parts[:-2])
    data = path.read_bytes()
    return data[:offset] + type_id.to_bytes(4, "little") + data[offset + 4:]
