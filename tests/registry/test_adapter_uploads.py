"""Adapter uploads: good ones stored as content-addressed blobs plus one row; every kind of
bad one refused with a clear error and the registry left exactly as it was."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from loraplex.adapter_format import BaseModelShape, load_adapter_dir
from loraplex.errors import AdapterError, LoraplexError, UnknownAdapterError
from loraplex.registry import Registry, RegistryConfig
from loraplex.registry.records import ServedModelRecord
from loraplex.registry.registry_errors import (
    AdapterNotFoundError,
    BaseModelUnknownError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
)
from loraplex.registry.tables import utcnow
from tests.registry.registry_support import (
    MAX_RANK,
    MODEL_ID,
    TINY,
    adapter_config,
    adapter_tensors,
    registry_state,
    write_adapter,
)


def _safetensors(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _with(tensors: dict[str, np.ndarray], change: Callable[[np.ndarray], None]):
    first = next(iter(tensors))
    change(tensors[first])
    return tensors


def _dora_tensors(v_length: int = 32) -> dict[str, np.ndarray]:
    """LoRA tensors on q/v with DoRA magnitudes (v_proj's of length `v_length`)."""
    tensors = adapter_tensors()
    for layer in range(TINY.num_layers):
        for module, length in (("q_proj", 64), ("v_proj", v_length)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_magnitude_vector"
            tensors[key] = np.ones(length, np.float32)
    return tensors


def _ia3_config(**overrides) -> dict:
    return {"peft_type": "IA3", "task_type": "CAUSAL_LM", "target_modules": ["q_proj", "down_proj"],
            "feedforward_modules": ["down_proj"], **overrides}


def _ia3_tensors(down_shape: tuple[int, int] = (1, 128), q_input: bool = False) -> dict[str, np.ndarray]:
    tensors = {}
    for layer in range(TINY.num_layers):
        prefix = f"base_model.model.model.layers.{layer}"
        tensors[f"{prefix}.self_attn.q_proj.ia3_l"] = np.ones((1, 64) if q_input else (64, 1), np.float32)
        tensors[f"{prefix}.mlp.down_proj.ia3_l"] = np.ones(down_shape, np.float32)
    return tensors


_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
BAD_ADAPTERS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "another PEFT type": (lambda d: write_adapter(d, adapter_config(peft_type="PREFIX_TUNING")),
                          "peft_type must be 'LORA', 'IA3' or 'FLORA'"),
    "DoRA config without magnitudes": (lambda d: write_adapter(d, adapter_config(use_dora=True)),
                                       "has no lora_magnitude_vector tensor"),
    "DoRA magnitude in a LoRA adapter": (lambda d: write_adapter(d, tensors=adapter_tensors() | {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
            np.ones(64, np.float32)}), "is a DoRA magnitude, but adapter_config.json does not set use_dora"),
    "DoRA magnitude of the wrong length": (
        lambda d: write_adapter(d, adapter_config(use_dora=True), _dora_tensors(v_length=64)),
        "layer 0 v_proj: DoRA magnitude (lora_magnitude_vector) has shape [64], but the base model "
        "needs [32]"),
    "IA3 vector of the wrong shape": (
        lambda d: write_adapter(d, _ia3_config(), _ia3_tensors(down_shape=(128, 1))),
        "layer 0 down_proj: ia3_l has shape [128, 1], but down_proj is a feed-forward module"),
    "IA3 input scaling of q_proj": (
        lambda d: write_adapter(d, _ia3_config(feedforward_modules=["q_proj", "down_proj"]),
                                _ia3_tensors(q_input=True)),
        "IA3 input scaling (feedforward_modules) is supported on o_proj, down_proj only"),
    "FLoRA config over LoRA tensors": (
        lambda d: write_adapter(d, adapter_config(peft_type="FLORA")),
        "belongs in a LoRA adapter, but adapter_config.json describes a flora one"),
    "modules_to_save": (lambda d: write_adapter(d, adapter_config(modules_to_save=["lm_head"])),
                        "modules_to_save"),
    "unsupported target in config": (
        lambda d: write_adapter(d, adapter_config(target_modules=["q_proj", "embed_tokens"])),
        "unsupported target modules: embed_tokens"),
    "unsupported target tensor": (
        lambda d: write_adapter(d, adapter_config(target_modules="all-linear"), tensors={
            "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight":
                np.zeros((4, 64), np.float32),
            "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight":
                np.zeros((128, 4), np.float32)}), "unsupported target module 'qkv_proj'"),
    "rank above the limit": (
        lambda d: write_adapter(d, adapter_config(r=16), adapter_tensors(rank=16)),
        "exceeds the limit of 8"),
    "shapes that do not fit": (
        lambda d: write_adapter(d, tensors=adapter_tensors(shape=dataclasses.replace(
            TINY, hidden_size=32))), "do not fit the base model"),
    "more layers than the base": (
        lambda d: write_adapter(d, tensors=adapter_tensors(shape=dataclasses.replace(
            TINY, num_layers=3))), "the base model has 2 layers"),
    "NaN": (lambda d: write_adapter(d, tensors=_with(adapter_tensors(),
                                                     lambda t: t.flat.__setitem__(3, np.nan))),
            "NaN or Inf"),
    "Inf": (lambda d: write_adapter(d, tensors=_with(adapter_tensors(),
                                                     lambda t: t.flat.__setitem__(0, np.inf))),
            "NaN or Inf"),
    "int32 dtype": (lambda d: write_adapter(d, tensors={
        k: v.astype(np.int32) for k, v in adapter_tensors().items()}), "dtype 'I32'"),
    "float64 dtype": (lambda d: write_adapter(d, tensors=adapter_tensors(dtype=np.float64)),
                      "dtype 'F64'"),
    "truncated safetensors": (lambda d: write_adapter(d, weights=b"\x01\x02"), "too short"),
    "header not JSON": (lambda d: write_adapter(d, weights=struct.pack("<Q", 5) + b"{nope"),
                        "header is not JSON"),
    "oversized header": (
        lambda d: write_adapter(d, weights=struct.pack("<Q", 64 << 20) + b"{}" * 8),
        "exceeds the"),
    "header past the end": (lambda d: write_adapter(d, weights=struct.pack("<Q", 999) + b"{}"),
                            "runs past the end"),
    "offsets that overlap": (lambda d: write_adapter(d, weights=_safetensors({
        _A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]},
        _A.replace("lora_A", "lora_B"): {"dtype": "F32", "shape": [64, 4],
                                         "data_offsets": [0, 1024]}}, bytes(2048))),
        "does not follow"),
    "tensor data cut short": (lambda d: write_adapter(d, weights=_safetensors({
        _A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}}, bytes(24))),
        "adapter_model.safetensors is truncated: its header promises 1024 bytes of tensor data and "
        "the file holds 24"),
    "header nested thousands deep": (lambda d: write_adapter(d, weights=_deep_header(5000)),
                                     "nested deeper than 4 levels"),
    "header nested past the bound": (lambda d: write_adapter(d, weights=_deep_header(6)),
                                     "nested deeper than 4 levels"),
    "config nested thousands deep": (lambda d: _replace_config(write_adapter(d), b"[" * 20000 + b"]" * 20000),
                                     "nested deeper than 16 levels"),
    "config nested past the bound": (lambda d: write_adapter(d, adapter_config(loftq_config=_nest({}, 17))),
                                     "nested deeper than 16 levels"),
    "target_modules pattern matching nothing": (
        lambda d: write_adapter(d, adapter_config(target_modules="attn_q")),
        "target_modules 'attn_q' selects no module of the base model"),
    "target_modules pattern narrower than the tensors": (
        lambda d: write_adapter(d, adapter_config(target_modules=r".*\.q_proj")),
        "adapter_model.safetensors adapts layer 0 v_proj, layer 1 v_proj, which adapter_config.json's "
        "target_modules '.*\\\\.q_proj' does not select"),
    "target_modules pattern selecting a norm": (
        lambda d: write_adapter(d, adapter_config(target_modules=r".*(q_proj|v_proj|norm)")),
        "selects model.norm, which loraplex cannot adapt (unsupported target module 'norm'"),
    "target_modules pattern that is not a regular expression": (
        lambda d: write_adapter(d, adapter_config(target_modules="q_proj(")),
        "'q_proj(' is not a valid regular expression"),
    "target_modules pattern that backtracks for ever": (
        lambda d: write_adapter(d, adapter_config(target_modules="(.*)" * 8 + "".join(
            f"\\{i}" for i in range(1, 9)) + "l")),
        "takes too long to match module names"),
    "target_modules without their tensors": (
        lambda d: write_adapter(d, adapter_config(target_modules=["q_proj", "k_proj", "v_proj"])),
        "target_modules [q_proj, k_proj, v_proj] selects layer 0 k_proj, layer 1 k_proj, but "
        "adapter_model.safetensors has no tensors for them"),
    "layers_to_transform narrower than the tensors": (
        lambda d: write_adapter(d, adapter_config(layers_to_transform=[0])),
        "adapts layer 1 q_proj, layer 1 v_proj, which"),
    "exclude_modules that the tensors ignore": (
        lambda d: write_adapter(d, adapter_config(exclude_modules=["model.layers.1.self_attn.v_proj"])),
        "adapts layer 1 v_proj, which"),
    "only a pickle .bin": (lambda d: _pickle_only(d), "pickle"),
    "config not JSON": (lambda d: _replace_config(write_adapter(d), b"{not json"),
                        "not valid JSON"),
    "no config": (lambda d: _remove(write_adapter(d) / "adapter_config.json"),
                  "has no adapter_config.json"),
}


def _nest(value: object, depth: int) -> object:
    for _ in range(depth):
        value = [value]
    return value


def _deep_header(depth: int) -> bytes:
    raw = b'{"x": ' + b"[" * depth + b"]" * depth + b"}"
    return struct.pack("<Q", len(raw)) + raw


def _pickle_only(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config()))
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")  # pickle of the int 1
    return folder


def _replace_config(folder: Path, raw: bytes) -> Path:
    (folder / "adapter_config.json").write_bytes(raw)
    return folder


def _remove(path: Path) -> Path:
    path.unlink()
    return path.parent


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_bad_adapters_are_refused_and_nothing_is_stored(
    registry: Registry, tmp_path: Path, case: str
) -> None:
    registry.adapters.upload_dir("acme", "existing", write_adapter(tmp_path / "good"))
    build, match = BAD_ADAPTERS[case]
    folder = build(tmp_path / "bad")
    before = registry_state(registry)
    with pytest.raises(AdapterError, match=re.escape(match)):
        registry.adapters.upload_dir("acme", "candidate", folder)
    assert registry_state(registry) == before


@pytest.mark.parametrize("name", ["", "../escape", "a/b", "has space", "x" * 65, "tab\t", ".."])
def test_bad_names_are_refused(registry: Registry, tmp_path: Path, name: str) -> None:
    folder = write_adapter(tmp_path / "a")
    before = registry_state(registry)
    with pytest.raises(InvalidInputError, match="invalid adapter name"):
        registry.adapters.upload_dir("acme", name, folder)
    assert registry_state(registry) == before


def test_duplicate_names_are_refused_per_tenant(registry: Registry, tmp_path: Path) -> None:
    registry.adapters.upload_dir("acme", "sql", write_adapter(tmp_path / "a"))
    before = registry_state(registry)
    other = write_adapter(tmp_path / "b", tensors=adapter_tensors(seed=5))
    with pytest.raises(ConflictError, match="'acme' already has an adapter named 'sql'"):
        registry.adapters.upload_dir("acme", "sql", other)
    assert registry_state(registry) == before
    registry.tenants.create("beta")
    assert registry.adapters.upload_dir("beta", "sql", other).tenant == "beta"


def test_other_refusals_store_nothing(registry: Registry, registry_config: RegistryConfig,
                                      tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    before = registry_state(registry)
    with pytest.raises(NotFoundError, match="tenant 'nobody' does not exist"):
        registry.adapters.upload_dir("nobody", "x", folder)
    with pytest.raises(AdapterError, match="does not exist"):
        registry.adapters.upload_dir("acme", "x", tmp_path / "missing")
    small = dataclasses.replace(registry_config, max_upload_bytes=1000)
    with Registry.open(small) as limited, pytest.raises(InvalidInputError, match="larger than"):
        limited.adapters.upload_dir("acme", "x", folder)
    assert registry_state(registry) == before


def test_without_a_served_model_uploads_name_the_problem(
    registry_config: RegistryConfig, tmp_path: Path
) -> None:
    with Registry.open(registry_config) as registry:
        registry.tenants.create("acme")
        folder = write_adapter(tmp_path / "a")
        with pytest.raises(BaseModelUnknownError, match="no served base model is recorded"):
            registry.adapters.upload_dir("acme", "x", folder)
        model = ServedModelRecord("local", TINY, max_lora_rank=4)
        assert registry.adapters.upload_dir("acme", "x", folder, model=model).base_model == "local"


def test_good_upload_is_content_addressed(registry: Registry, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", adapter_config(
        target_modules=["q_proj", "v_proj", "down_proj"]),
        adapter_tensors(modules=("q_proj", "v_proj", "down_proj")))
    record = registry.adapters.upload_dir("acme", "sql.v1_2-x", folder, actor=3)
    expected = load_adapter_dir(folder, TINY, MAX_RANK)
    weights = (folder / "adapter_model.safetensors").read_bytes()
    config = (folder / "adapter_config.json").read_bytes()
    assert record.digest == expected.digest
    assert (record.rank, record.alpha, record.base_model) == (4, 8.0, MODEL_ID)
    assert record.target_modules == ("q_proj", "v_proj", "down_proj")
    assert record.size_bytes == len(weights)
    assert record.weights_sha256 == hashlib.sha256(weights).hexdigest()
    assert record.weights_path.read_bytes() == weights
    assert record.config_path.read_bytes() == config
    blob_dir = registry.blobs.blob_dir
    assert record.weights_path == blob_dir / record.weights_sha256[:2] / record.weights_sha256
    assert record.created_at <= utcnow() and record.num_requests_served == 0
    assert registry.adapters.get("acme", "sql.v1_2-x") == record
    assert registry.adapters.list("acme") == (record,)
    (entry,) = [e for e in registry.audit.list() if e.action == "adapter.upload"]
    assert (entry.actor_key_id, entry.object_id) == (3, "acme/sql.v1_2-x")
    assert entry.details["digest"] == record.digest
    assert list(registry.blobs.temp_dir.iterdir()) == []


def test_stream_upload_matches_folder_upload_and_dedupes(registry: Registry,
                                                         tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    config = (folder / "adapter_config.json").read_bytes()
    weights = (folder / "adapter_model.safetensors").read_bytes()
    first = registry.adapters.upload_dir("acme", "first", folder)
    second = registry.adapters.upload("acme", "second", config, io.BytesIO(weights))
    third = registry.adapters.upload("acme", "third", config, str(folder /
                                                                  "adapter_model.safetensors"))
    assert first.digest == second.digest == third.digest
    assert len(list(registry.blobs.digests())) == 2  # one config blob, one weights blob
    registry.adapters.delete("acme", "first")
    registry.adapters.delete("acme", "second")
    assert third.weights_path.is_file()
    registry.adapters.delete("acme", "third")
    assert list(registry.blobs.digests()) == []
    assert not third.weights_path.exists()


def test_half_precision_adapters_are_accepted(registry: Registry, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", tensors=adapter_tensors(dtype=np.float16))
    assert registry.adapters.upload_dir("acme", "half", folder).rank == 4


def test_unknown_adapters_are_model_not_found(registry: Registry, tmp_path: Path) -> None:
    registry.adapters.upload_dir("acme", "mine", write_adapter(tmp_path / "a"))
    registry.tenants.create("beta")
    with pytest.raises(AdapterNotFoundError) as caught:
        registry.adapters.get("beta", "mine")  # another tenant's adapter
    assert caught.value.code == "model_not_found"
    assert isinstance(caught.value, UnknownAdapterError) and isinstance(caught.value,
                                                                         LoraplexError)
    assert "tenant 'beta' has no adapter named 'mine'" in str(caught.value)
    with pytest.raises(AdapterNotFoundError):
        registry.adapters.delete("beta", "mine")
    assert registry.adapters.list("beta") == ()


def test_served_model_record_round_trips(registry: Registry) -> None:
    other = BaseModelShape(num_layers=32, hidden_size=4096, intermediate_size=14336,
                           num_heads=32, num_kv_heads=8, head_dim=128)
    record = registry.models.set("meta-llama/Llama-3-8B", other, 64)
    assert registry.models.get() == record
    assert (record.shape, record.max_lora_rank) == (other, 64)
    with pytest.raises(InvalidInputError):
        registry.models.set("", other, 64)
