"""Loading a model folder: sharded safetensors, dtypes, and clear refusals."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.errors import ModelLoadError
from tests.factories import TINY, make_hf_model

PROMPT = [[5, 17, 42, 9, 100, 3]]


def test_sharded_checkpoint_matches_single_file(tmp_path):
    make_hf_model("llama", tmp_path / "single")
    make_hf_model("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    single = LLM(tmp_path / "single", device="cpu").generate(prompt_token_ids=PROMPT, sampling_params=params)
    sharded = LLM(tmp_path / "sharded", device="cpu").generate(
        prompt_token_ids=PROMPT, sampling_params=params)
    assert single[0].token_ids == sharded[0].token_ids


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_runs_close_to_float32(tmp_path, dtype):
    make_hf_model("qwen2", tmp_path / "model")
    reference = LLM(tmp_path / "model", device="cpu", dtype="float32")
    half = LLM(tmp_path / "model", device="cpu", dtype=dtype)
    assert half.engine.model.embed_tokens.dtype == getattr(torch, dtype)
    assert half.engine.kv_cache.dtype == getattr(torch, dtype)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    ours = half.generate(prompt_token_ids=PROMPT, sampling_params=params)[0].logprobs[0]
    ref = reference.generate(prompt_token_ids=PROMPT, sampling_params=params)[0].logprobs[0]
    assert ours.token_id == ref.token_id
    for token, logprob in ref.top.items():
        assert ours.top.get(token, -99) == pytest.approx(logprob, abs=0.1)


def test_refuses_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported architecture GPT2LMHeadModel; loraplex serves"):
        LLM(tmp_path, device="cpu")


def test_refuses_pickle_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.factories import hf_config

    model = AutoModelForCausalLM.from_config(hf_config("llama"))
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only pickle checkpoints .*never unpickles"):
        LLM(tmp_path, device="cpu")


def test_refuses_missing_files_and_tensors(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        LLM(tmp_path, device="cpu")
    make_hf_model("llama", tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no model.safetensors"):
        LLM(tmp_path / "model", device="cpu")
    make_hf_model("llama", tmp_path / "deeper")
    config = json.loads((tmp_path / "deeper" / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "deeper" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model.layers.2.input_layernorm.weight is missing"):
        LLM(tmp_path / "deeper", device="cpu")


def test_refuses_unsupported_rope(tmp_path):
    make_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is not supported"):
        LLM(tmp_path, device="cpu")


def test_context_is_capped_and_long_prompts_refused(tmp_path):
    from loraplex.errors import InvalidRequestError

    make_hf_model("mistral", tmp_path)
    llm = LLM(tmp_path, device="cpu", max_model_len=64)
    assert llm.engine.max_model_len == 64
    with pytest.raises(InvalidRequestError, match="the prompt has 64 tokens; this model's context is 64"):
        llm.generate(prompt_token_ids=[[5] * 64])
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[5] * 60], sampling_params=params)
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 4
    assert TINY["max_position_embeddings"] == 512
    with pytest.raises(ModelLoadError, match="max_model_len 1000 exceeds this model's 512"):
        LLM(tmp_path, device="cpu", max_model_len=1000)


def test_a_config_nested_thousands_deep_is_refused_in_one_line(tmp_path):
    from loraplex.errors import ModelLoadError
    from loraplex.model.model_config import ModelConfig

    (tmp_path / "config.json").write_text('{"a": ' * 5000 + "1" + "}" * 5000)
    with pytest.raises(ModelLoadError, match="is not valid JSON: .*nested"):
        ModelConfig.load(tmp_path)


@pytest.mark.parametrize(("name_or_path", "name"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    ("/fsx/runs/smollm2/final/", "final"),
    ("./checkpoints/step-100", "step-100"),
    ("runs/a/b", "b"),
    ("", None),
    (None, None),
])
def test_the_model_name_comes_from_name_or_path(name_or_path, name):
    from loraplex.model.model_config import ModelConfig
    from tests.factories import hf_config

    data = hf_config("qwen2").to_dict() | {"_name_or_path": name_or_path}
    assert ModelConfig.from_dict(data).name == name
