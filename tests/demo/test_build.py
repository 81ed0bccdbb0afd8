"""The built demo: a standard Hugging Face model folder and PEFT adapter folders that
transformers, PEFT and loraplex's own adapter validation load, and adapters that each answer the
demo prompt in their own readable voice."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from loraplex.adapter_format import load_adapter_dir
from loraplex.demo import DEMO_ADAPTERS, DEMO_PROMPT, DEMO_SYSTEM_PROMPT, ensure_demo
from loraplex.demo.answers import greedy_answer
from loraplex.demo.corpus import BASE_STYLE, TOPICS
from loraplex.model.model_config import ModelConfig

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json", "special_tokens_map.json")
READABLE = re.compile(r"[A-Za-z0-9 ,.!?:;'\-]+")


def _is_readable(text: str) -> bool:
    words = re.findall(r"[A-Za-z]+", text)
    return bool(READABLE.fullmatch(text)) and len(words) >= 3


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z]+", text))


def test_model_folder_is_a_small_gqa_llama(demo_assets):
    assert sorted(path.name for path in demo_assets.model_dir.iterdir()) == sorted(MODEL_FILES)
    config = AutoConfig.from_pretrained(demo_assets.model_dir)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.max_position_embeddings >= 1024
    tokenizer = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    assert config.vocab_size == len(tokenizer)
    assert (config.bos_token_id, config.eos_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id)
    weights = load_file(demo_assets.model_dir / "model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}


def test_loads_with_transformers_and_peft(demo_assets, demo_model):
    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir)
    assert next(model.parameters()).dtype == torch.float32
    assert list(demo_model.model.peft_config) == [adapter.name for adapter in DEMO_ADAPTERS]


@pytest.mark.parametrize("adapter", DEMO_ADAPTERS, ids=lambda adapter: adapter.name)
def test_adapter_folders(demo_assets, adapter):
    folder = demo_assets.adapters[adapter.name]
    assert sorted(path.name for path in folder.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["target_modules"] == sorted(adapter.target_modules)
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (
        adapter.rank, adapter.alpha, adapter.use_rslora)
    # loraplex's own validation (the engine's and the registry's) accepts it
    shape = ModelConfig.load(demo_assets.model_dir).shape
    loaded = load_adapter_dir(folder, shape, max_rank=64)
    assert loaded.rank == adapter.rank
    assert set(loaded.target_modules) == set(adapter.target_modules)
    assert len(loaded.modules) == shape.num_layers * len(adapter.target_modules)
    for module in loaded.modules.values():
        assert module.a.dtype.name == "float32"


def test_adapters_cover_mixed_ranks_and_targets():
    assert len({adapter.rank for adapter in DEMO_ADAPTERS}) == len(DEMO_ADAPTERS)
    assert len({adapter.target_modules for adapter in DEMO_ADAPTERS}) == len(DEMO_ADAPTERS)
    assert any(adapter.use_rslora for adapter in DEMO_ADAPTERS)


def test_each_voice_answers_the_demo_prompt(demo_model):
    base = greedy_answer(demo_model, DEMO_PROMPT)
    assert _is_readable(base), base
    assert base == TOPICS[0].answer(BASE_STYLE)
    answers = {None: base}
    for adapter in DEMO_ADAPTERS:
        text = greedy_answer(demo_model, DEMO_PROMPT, adapter.name)
        assert _is_readable(text), (adapter.name, text)
        assert adapter.marker in _words(text), (adapter.name, text)
        assert adapter.marker not in _words(base)
        answers[adapter.name] = text
    assert len(set(answers.values())) == len(answers), answers


def test_voices_hold_with_the_demo_system_prompt(demo_model):
    for adapter in DEMO_ADAPTERS:
        text = greedy_answer(demo_model, DEMO_PROMPT, adapter.name, system_prompt=DEMO_SYSTEM_PROMPT)
        assert _is_readable(text) and adapter.marker in _words(text), (adapter.name, text)


def test_second_ensure_demo_reuses_the_build(demo_build, demo_data_dir):
    assets, _ = demo_build
    files = sorted(path for path in (demo_data_dir / "demo").rglob("*") if path.is_file())
    before = {path: path.stat().st_mtime_ns for path in files}
    start = time.perf_counter()
    again = ensure_demo(demo_data_dir)
    assert time.perf_counter() - start < 1.0
    assert again == assets
    assert {path: path.stat().st_mtime_ns for path in files} == before
