"""Every adapter the engine must refuse raises AdapterError naming the problem, and a good
adapter's digest is its identity (same tensors and scaling -> same digest)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapter_format import BaseModelShape, load_adapter_dir
from loraplex.errors import AdapterError
from tests.factories import (
    TINY,
    AdapterSpec,
    make_adapter,
    make_dora_adapter,
    make_flora_adapter,
    make_hf_model,
    make_ia3_adapter,
)

SHAPE = BaseModelShape(num_layers=2, hidden_size=64, intermediate_size=96, num_heads=4,
                       num_kv_heads=2, head_dim=16)
GOOD = AdapterSpec("good", ("q_proj", "v_proj", "down_proj"), rank=4, alpha=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("base") / "model")


@pytest.fixture()
def good(base, tmp_path):
    return make_adapter(base, GOOD, tmp_path)


def _peft(base, tmp_path, **config):
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(task_type="CAUSAL_LM", **config))
    path = tmp_path / "adapter"
    model.save_pretrained(path)
    return path


def _edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _edit_tensors(path, edit):
    tensors = load_file(path / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, path / "adapter_model.safetensors")


def test_good_adapter_loads(good):
    adapter = load_adapter_dir(good, SHAPE, max_rank=64)
    assert adapter.rank == 4
    assert adapter.target_modules == ("q_proj", "v_proj", "down_proj")
    assert len(adapter.modules) == 2 * 3
    module = adapter.modules[(0, "q_proj")]
    assert module.a.shape == (4, 64) and module.b.shape == (64, 4)
    assert module.scaling == pytest.approx(8 / 4)


def test_digest_is_content_identity(good, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(good, copy)
    _edit_config(copy, base_model_name_or_path="renamed")  # metadata: same identity
    assert load_adapter_dir(copy, SHAPE, 64).digest == load_adapter_dir(good, SHAPE, 64).digest
    _edit_config(copy, lora_alpha=16)  # different scaling: a different adapter
    assert load_adapter_dir(copy, SHAPE, 64).digest != load_adapter_dir(good, SHAPE, 64).digest


@pytest.mark.parametrize("config, message", [
    (dict(r=4, target_modules=["q_proj", "lm_head"]), "unsupported target modules: lm_head"),
    (dict(r=4, target_modules=["embed_tokens"]), "unsupported target modules: embed_tokens"),
    (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save is not supported"),
    (dict(r=4, target_modules=["q_proj"], lora_bias=True), "lora_bias"),
    (dict(r=128, target_modules=["q_proj"]), "rank 128 exceeds the limit of 64"),
])
def test_refused_peft_configs(base, tmp_path, config, message):
    path = _peft(base, tmp_path, **config)
    with pytest.raises(AdapterError, match=message):
        load_adapter_dir(path, SHAPE, max_rank=64)


@pytest.mark.parametrize("targets", [
    dict(target_modules=r".*\.(q_proj|down_proj)"),  # a regular expression over module names
    dict(target_modules=r"model\.layers\.1\.self_attn\.[kv]_proj"),
    dict(target_modules=["self_attn.q_proj", "model.layers.0.mlp.up_proj"]),  # dotted suffixes
    dict(target_modules=["q_proj", "o_proj"], layers_to_transform=[1]),
    dict(target_modules=["q_proj", "v_proj"], layers_to_transform=0, layers_pattern="layers"),
    dict(target_modules="all-linear", exclude_modules=["k_proj", "model.layers.0.mlp.gate_proj"]),
    dict(target_modules=["q_proj", "gate_proj"], exclude_modules=r".*\.1\..*"),
])
def test_target_modules_mean_what_they_mean_to_peft(base, tmp_path, targets):
    """Whatever PEFT adapts for a config is what is loaded; a config that says otherwise than
    the tensors is refused, naming the difference."""
    path = _peft(base, tmp_path, r=4, lora_alpha=8, **targets)
    peft_modules = {(int(m[1]), m[2]) for m in (
        re.match(r".*layers\.(\d+)\.\w+\.(\w+)\.lora_A", n) for n in load_file(
            path / "adapter_model.safetensors")) if m}
    assert set(load_adapter_dir(path, SHAPE, max_rank=64).modules) == peft_modules
    _edit_config(path, target_modules=r"model\.layers\.0\..*_proj", layers_to_transform=None,
                 exclude_modules=None)
    with pytest.raises(AdapterError, match="adapter_config.json's target_modules .* selects|which "
                                           "adapter_config.json's target_modules .* does not select"):
        load_adapter_dir(path, SHAPE, max_rank=64)


def test_refuses_adapter_for_another_base_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(**{**TINY, "hidden_size": 32}))
    path = _peft(other, tmp_path, r=4, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"do not fit the base model, which needs lora_A \[r, 64\]"):
        load_adapter_dir(path, SHAPE, max_rank=64)


def test_refuses_adapter_with_more_layers(base, tmp_path):
    path = _peft(base, tmp_path, r=4, target_modules=["q_proj"])
    one_layer = BaseModelShape(**{**SHAPE.__dict__, "num_layers": 1})
    with pytest.raises(AdapterError, match="for layer 1, but the base model has 1 layers"):
        load_adapter_dir(path, one_layer, max_rank=64)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_refuses_non_finite_values(good, value):
    def poison(tensors):
        name = next(n for n in tensors if "lora_B" in n)
        tensors[name][0, 0] = value

    _edit_tensors(good, poison)
    with pytest.raises(AdapterError, match="NaN or Inf"):
        load_adapter_dir(good, SHAPE, max_rank=64)


def test_refuses_pickle_only_folder(base, tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    assert (tmp_path / "pickled" / "adapter_model.bin").is_file()
    with pytest.raises(AdapterError, match="only adapter_model.bin, a pickle file"):
        load_adapter_dir(tmp_path / "pickled", SHAPE, max_rank=64)


def test_refuses_missing_config_and_weights(good, tmp_path):
    (good / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        load_adapter_dir(good, SHAPE, max_rank=64)
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):
        load_adapter_dir(tmp_path / "empty", SHAPE, max_rank=64)


def test_refuses_unpaired_and_mismatched_ranks(good):
    def drop_b(tensors):
        del tensors[next(n for n in tensors if "lora_B" in n)]

    _edit_tensors(good, drop_b)
    with pytest.raises(AdapterError, match="has no lora_B tensor"):
        load_adapter_dir(good, SHAPE, max_rank=64)


def test_refuses_rank_that_disagrees_with_config(good):
    _edit_config(good, r=8)
    with pytest.raises(AdapterError, match="tensors have rank 4 but adapter_config.json gives rank 8"):
        load_adapter_dir(good, SHAPE, max_rank=64)


@pytest.mark.parametrize("header, message", [
    (b"\xff" * 8, "exceeds the"),
    ((10).to_bytes(8, "little") + b"not json!!", "header is not JSON"),
    ((2).to_bytes(8, "little") + b"[]", "must be a JSON object"),
])
def test_refuses_malformed_safetensors(good, header, message):
    (good / "adapter_model.safetensors").write_bytes(header)
    with pytest.raises(AdapterError, match=message):
        load_adapter_dir(good, SHAPE, max_rank=64)


def test_refuses_disallowed_dtype_and_bad_offsets(good):
    tensors = load_file(good / "adapter_model.safetensors")
    save_file({k: v.to(torch.float64) for k, v in tensors.items()}, good / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="dtype 'F64'; allowed: F32, F16, BF16"):
        load_adapter_dir(good, SHAPE, max_rank=64)
    save_file(tensors, good / "adapter_model.safetensors")
    data = (good / "adapter_model.safetensors").read_bytes()
    (good / "adapter_model.safetensors").write_bytes(data + b"\0" * 4)
    with pytest.raises(AdapterError, match="4 bytes of data after the last tensor belong to no tensor"):
        load_adapter_dir(good, SHAPE, max_rank=64)


def test_refused_adapter_leaves_engine_adapters_unchanged(tmp_path):
    from loraplex import LLM

    base = make_hf_model("llama", tmp_path / "model")
    good_path = make_adapter(base, GOOD, tmp_path)
    llm = LLM(tmp_path / "model", device="cpu", dtype="float32")
    llm.add_adapter("good", good_path)
    bad = _peft(base, tmp_path, r=128, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="exceeds"):
        llm.add_adapter("bad", bad)
    assert set(llm.engine.local_adapters.names) == {"good"}


# Families ------------------------------------------------------------------------------------
def test_peft_dora_loads_with_its_magnitudes(base, tmp_path):
    path = make_dora_adapter(base, tmp_path / "dora", ("q_proj", "down_proj"), rank=2, alpha=4)
    adapter = load_adapter_dir(path, SHAPE, 64)
    assert adapter.family == "dora" and adapter.rank == 2
    module = adapter.modules[(1, "down_proj")]
    assert module.magnitude.shape == (64,) and module.scaling == pytest.approx(2.0)
    plain = tmp_path / "plain"
    shutil.copytree(path, plain)
    _edit_config(plain, use_dora=False)
    with pytest.raises(AdapterError, match="is a DoRA magnitude, but adapter_config.json does not set "
                                           "use_dora"):
        load_adapter_dir(plain, SHAPE, 64)
    _edit_tensors(plain, lambda t: [t.pop(k) for k in list(t) if "magnitude" in k])
    assert load_adapter_dir(plain, SHAPE, 64).digest != adapter.digest  # same A, B: not the same


def test_dora_magnitude_of_wrong_length_names_the_module(base, tmp_path):
    path = make_dora_adapter(base, tmp_path / "dora", ("q_proj", "down_proj"), rank=2, alpha=4)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector"
    _edit_tensors(path, lambda t: t.update({key: torch.ones(96)}))
    with pytest.raises(AdapterError, match=re.escape("layer 1 down_proj: DoRA magnitude "
                                                     "(lora_magnitude_vector) has shape [96]")):
        load_adapter_dir(path, SHAPE, 64)
    _edit_tensors(path, lambda t: t.pop(key))
    with pytest.raises(AdapterError, match="layer 1 down_proj has no lora_magnitude_vector tensor"):
        load_adapter_dir(path, SHAPE, 64)


def test_peft_ia3_loads_and_checks_its_vectors(base, tmp_path):
    path = make_ia3_adapter(base, tmp_path / "ia3", ("k_proj", "v_proj", "down_proj"), ("down_proj",))
    adapter = load_adapter_dir(path, SHAPE, 64)
    assert adapter.family == "ia3" and adapter.rank == 0 and not adapter.modules
    assert adapter.target_modules == ("k_proj", "v_proj", "down_proj")
    down = adapter.vectors[(0, "down_proj")]
    assert down.is_input and down.values.shape == (96,)
    assert not adapter.vectors[(0, "k_proj")].is_input
    key = "base_model.model.model.layers.0.self_attn.v_proj.ia3_l"
    _edit_tensors(path, lambda t: t.update({key: torch.ones(1, 64)}))
    with pytest.raises(AdapterError, match=re.escape("layer 0 v_proj: ia3_l has shape [1, 64]")):
        load_adapter_dir(path, SHAPE, 64)


def test_ia3_input_scaling_of_a_fused_projection_is_refused(base, tmp_path):
    path = make_ia3_adapter(base, tmp_path / "ia3", ("q_proj", "v_proj"), ("q_proj",))
    with pytest.raises(AdapterError, match="IA3 input scaling .* supported on o_proj, down_proj only"):
        load_adapter_dir(path, SHAPE, 64)


def test_flora_folder_loads_and_is_checked(base, tmp_path):
    path = make_flora_adapter(base, tmp_path / "flora", ("q_proj", "up_proj"), rank=3)
    adapter = load_adapter_dir(path, SHAPE, 64)
    assert adapter.family == "flora" and adapter.rank == 3
    assert adapter.modules[(0, "up_proj")].scaling == 1.0
    _edit_config(path, r=4)
    with pytest.raises(AdapterError, match="tensors have rank 3 but adapter_config.json gives rank 4"):
        load_adapter_dir(path, SHAPE, 64)
    _edit_config(path, r=3, peft_type="LORA")
    with pytest.raises(AdapterError, match="belongs in a FLoRA adapter, but adapter_config.json "
                                           "describes a lora one"):
        load_adapter_dir(path, SHAPE, 64)
    _edit_config(path, peft_type="FLORA")
    key = "base_model.model.model.layers.0.mlp.up_proj.flora_B.weight"
    _edit_tensors(path, lambda t: t.update({key: torch.ones(64, 3)}))
    with pytest.raises(AdapterError, match=re.escape("layer 0 up_proj: shapes flora_A [3, 64] and "
                                                     "flora_B [64, 3] do not fit")):
        load_adapter_dir(path, SHAPE, 64)
