"""Adapters of four families: PEFT LoRA, PEFT DoRA (LoRA with `use_dora`), PEFT IA3, and FLoRA
(loraplex's format for multiplicative adapters, docs/flora-format.md): parsing and validation,
the one code path that the engine (loading) and the registry (uploads) share. Torch-free:
safetensors files are parsed here by hand, with every header field checked, and values are read
into numpy (bf16 widened to float32 by bit shift). Nothing is ever unpickled.

An adapter is refused with an AdapterError naming the problem: another PEFT type, modules_to_save,
unsupported target modules, tensors that disagree with the modules the config targets (by PEFT's
rules, loraplex.adapter_targets) or with its family, rank above the limit, shapes that do not fit
the base model (a DoRA magnitude or an IA3 vector of the wrong length included), NaN/Inf,
disallowed dtypes, a malformed, oversized, too deeply nested or truncated file, or only a pickle
file. Messages name the files by their PEFT names (never a server path) and quote values from the
files only in short.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import regex

from loraplex.adapter_targets import MATCH_TIME_LIMIT_S, SUPPORTED_MODULES, TargetSpec, block_of
from loraplex.errors import AdapterError
from loraplex.json_limits import loads_bounded

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

MAX_CONFIG_BYTES = 64 * 1024
MAX_CONFIG_DEPTH = 16
"""PEFT's own configs nest 3 deep (loftq_config, layer_replication)."""
MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_HEADER_DEPTH = 4
"""A safetensors header is {name: {dtype, shape: [...], data_offsets: [...]}}: 3 deep."""
MAX_TENSORS = 8192
MAX_PATTERN_LENGTH = 256
MAX_QUOTED_CHARS = 80
IA3_INPUT_MODULES = ("o_proj", "down_proj")
"""Modules whose input an IA3 vector may scale: the others share their input product (q/k/v,
gate/up are one product in the engine)."""
"""Values from the files are quoted in messages up to this length."""

_DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),  # widened to float32 on read
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\."
    r"(lora_A\.weight|lora_B\.weight|lora_magnitude_vector|ia3_l|flora_A\.weight|flora_B\.weight)$"
)
FAMILIES = ("lora", "dora", "ia3", "flora")
"""lora: W0 + s B A. dora: m / ||W0 + s B A||_row * (W0 + s B A). ia3: W0 scaled by a vector on
its output (or, for feed-forward modules, its input). flora: W0 * (B A), element-wise."""
_PEFT_TYPES = {"LORA": "lora", "IA3": "ia3", "FLORA": "flora"}
# The tensors of one adapted module, by family: tensor suffix -> part.
_PARTS = {
    "lora": {"lora_A.weight": "A", "lora_B.weight": "B"},
    "dora": {"lora_A.weight": "A", "lora_B.weight": "B", "lora_magnitude_vector": "M"},
    "ia3": {"ia3_l": "L"},
    "flora": {"flora_A.weight": "A", "flora_B.weight": "B"},
}
_MODULE_PATH = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
# Config keys that change the math of inference; PEFT features we do not implement.
_UNSUPPORTED_FEATURES = (
    "layer_replication", "trainable_token_indices", "target_parameters",
    "alora_invocation_tokens", "lora_bias", "use_qalora",
)


@dataclass(frozen=True)
class BaseModelShape:
    """The dimensions of the served base model that an adapter must fit."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def features(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target module."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }[module]


@dataclass(frozen=True)
class LoraModule:
    """One adapted module of one layer. `a` is [rank, in_features], `b` [out_features, rank],
    both float32. LoRA: the output gains `x @ a.T @ b.T * scaling`. DoRA: the same, and the
    sum is scaled per output row by `magnitude / ||W0 + scaling * b @ a||_row` ([out_features]).
    FLoRA: the weight becomes `W0 * (b @ a)` (scaling 1)."""

    layer: int
    module: str
    a: np.ndarray
    b: np.ndarray
    scaling: float
    magnitude: np.ndarray | None = None

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class Ia3Vector:
    """IA3's learned vector of one module of one layer (float32): it scales the module's input
    ([in_features], a feed-forward module) or its output ([out_features], bias included)."""

    layer: int
    module: str
    values: np.ndarray
    is_input: bool


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of adapter_config.json that inference uses."""

    rank: int
    alpha: float
    use_rslora: bool
    targets: TargetSpec
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    base_model_name: str | None
    family: str = "lora"
    feedforward_modules: tuple[str, ...] | str | None = None
    """IA3: the modules whose input (not output) the vector scales (PEFT's rule: a list entry
    is a suffix of the module name, a string a regular expression over the whole name)."""

    def scaling(self, module_path: str) -> tuple[int, float]:
        """(rank, scaling) that PEFT would give the module at `module_path`
        (e.g. `model.layers.3.self_attn.q_proj`)."""
        rank = self.rank_pattern.get(_pattern_key(self.rank_pattern, module_path), self.rank)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module_path), self.alpha)
        return rank, alpha / (math.sqrt(rank) if self.use_rslora else rank)


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter. `digest` is its identity everywhere: the sha256 of its canonical
    tensors (name, dtype, shape, bytes, in name order) and the scaling applied to each."""

    digest: str
    config: AdapterConfig
    modules: dict[tuple[int, str], LoraModule]
    num_bytes: int
    vectors: dict[tuple[int, str], Ia3Vector] = field(default_factory=dict)
    """IA3 adapters: their vectors (`modules` is empty)."""

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def rank(self) -> int:
        """The largest rank of its modules (0 for IA3)."""
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def target_modules(self) -> tuple[str, ...]:
        present = {module for _, module in (*self.modules, *self.vectors)}
        return tuple(m for m in SUPPORTED_MODULES if m in present)


def load_adapter_dir(path: str | Path, base: BaseModelShape, max_rank: int) -> LoraAdapter:
    """Load and validate a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
    config_path, weights_path = find_adapter_files(path)
    return load_adapter(config_path.read_bytes(), weights_path, base, max_rank)


def find_adapter_files(path: str | Path) -> tuple[Path, Path]:
    """(config path, weights path) of a PEFT adapter folder, refusing pickle-only folders and
    oversized configs."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist")
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not weights_path.is_file():
        pickles = [name for name in PICKLE_NAMES if (folder / name).is_file()]
        if pickles:
            raise AdapterError(
                f"{folder} holds only {pickles[0]}, a pickle file, which loraplex never loads; "
                f"save the adapter with safetensors (save_pretrained(..., safe_serialization=True))"
            )
        raise AdapterError(f"{folder} has no {WEIGHTS_NAME}")
    if not config_path.is_file():
        raise AdapterError(f"{folder} has no {CONFIG_NAME}")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes")
    return config_path, weights_path


def load_adapter(
    config: bytes | str | dict[str, Any], weights_path: str | Path, base: BaseModelShape, max_rank: int
) -> LoraAdapter:
    """Validate a parsed or raw adapter config and a safetensors weights file against `base`."""
    adapter_config = parse_adapter_config(config, max_rank)
    weights_path = Path(weights_path)
    tensors = read_safetensors(weights_path, name=WEIGHTS_NAME)
    parts_of = _group_tensors(tensors, adapter_config, base)
    modules: dict[tuple[int, str], LoraModule] = {}
    vectors: dict[tuple[int, str], Ia3Vector] = {}
    hasher = hashlib.sha256()
    if adapter_config.family != "lora":  # plain LoRA digests stay what they always were
        hasher.update(f"family={adapter_config.family};".encode())
    for (layer, module), parts in sorted(parts_of.items()):
        raw = {part: tensors[name] for part, name in parts.items()}
        for name in parts.values():
            if not np.isfinite(tensors[name].values()).all():
                raise AdapterError(f"tensor {name} contains NaN or Inf values")
        if adapter_config.family == "ia3":
            vectors[(layer, module)] = _ia3_vector(layer, module, raw["L"], adapter_config, base)
        else:
            modules[(layer, module)] = _lora_module(layer, module, raw, adapter_config, base, max_rank)
        for part in sorted(raw):
            raw[part].update_digest(hasher)
        if adapter_config.family in ("lora", "dora"):
            hasher.update(f"scaling={modules[(layer, module)].scaling!r};".encode())
        elif adapter_config.family == "ia3":
            hasher.update(f"input={vectors[(layer, module)].is_input};".encode())
    if not modules and not vectors:
        raise AdapterError(f"{WEIGHTS_NAME} holds no adapter tensors")
    return LoraAdapter(hasher.hexdigest(), adapter_config, modules, weights_path.stat().st_size, vectors)


def _lora_module(layer: int, module: str, raw: dict[str, RawTensor], config: AdapterConfig,
                 base: BaseModelShape, max_rank: int) -> LoraModule:
    """A LoRA, DoRA or FLoRA module, its shapes checked against the base model."""
    rank = _check_shapes(layer, module, raw["A"], raw["B"], config, base, max_rank)
    path = f"model.layers.{layer}.{block_of(module)}.{module}"
    if config.family == "flora":
        if rank != config.rank:
            raise AdapterError(f"{path}: tensors have rank {rank} but {CONFIG_NAME} gives rank "
                               f"{config.rank}")
        return LoraModule(layer, module, raw["A"].values(), raw["B"].values(), 1.0)
    config_rank, scaling = config.scaling(path)
    if config_rank != rank:
        raise AdapterError(
            f"{path}: tensors have rank {rank} but adapter_config.json gives rank {config_rank}"
        )
    magnitude = None
    if config.family == "dora":
        out_features = base.features(module)[1]
        m = raw["M"]
        if len(m.shape) != 1 or m.shape[0] != out_features:
            raise AdapterError(f"layer {layer} {module}: DoRA magnitude (lora_magnitude_vector) has "
                               f"shape {list(m.shape)}, but the base model needs [{out_features}]")
        magnitude = m.values()
    return LoraModule(layer, module, raw["A"].values(), raw["B"].values(), scaling, magnitude)


def _ia3_vector(layer: int, module: str, raw: RawTensor, config: AdapterConfig,
                base: BaseModelShape) -> Ia3Vector:
    """IA3's vector: [1, in_features] on a feed-forward module, [out_features, 1] elsewhere."""
    in_features, out_features = base.features(module)
    path = f"model.layers.{layer}.{block_of(module)}.{module}"
    is_input = _is_feedforward(config.feedforward_modules, path)
    expected = [1, in_features] if is_input else [out_features, 1]
    if list(raw.shape) != expected:
        role = "a feed-forward module (its input is scaled)" if is_input else \
            "not a feed-forward module (its output is scaled)"
        raise AdapterError(f"layer {layer} {module}: ia3_l has shape {list(raw.shape)}, but {module} is "
                           f"{role} and needs {expected}")
    if is_input and module not in IA3_INPUT_MODULES:
        raise AdapterError(f"layer {layer} {module}: IA3 input scaling (feedforward_modules) is "
                           f"supported on {', '.join(IA3_INPUT_MODULES)} only ({module} shares its "
                           f"input product with other projections)")
    return Ia3Vector(layer, module, raw.values().reshape(-1), is_input)


def _is_feedforward(spec: tuple[str, ...] | str | None, path: str) -> bool:
    """PEFT's rule for IA3's feedforward_modules."""
    if spec is None:
        return False
    if isinstance(spec, str):
        try:
            return regex.fullmatch(spec, path, timeout=MATCH_TIME_LIMIT_S) is not None
        except TimeoutError:
            raise AdapterError(f"feedforward_modules {_quote(spec)} takes too long to match module "
                               f"names") from None
    return any(path.endswith(entry) for entry in spec)


def parse_adapter_config(raw: bytes | str | dict[str, Any], max_rank: int) -> AdapterConfig:
    """Check adapter_config.json against what loraplex serves."""
    if isinstance(raw, (bytes, str)):
        if len(raw) > MAX_CONFIG_BYTES:
            raise AdapterError(f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes")
        try:
            data = loads_bounded(raw, MAX_CONFIG_DEPTH)
        except ValueError as exc:  # UnicodeDecodeError and JSONTooDeepError are ValueErrors
            raise AdapterError(f"{CONFIG_NAME} is not valid JSON: {exc}") from None
    else:
        data = raw
    if not isinstance(data, dict):
        raise AdapterError(f"{CONFIG_NAME} must hold a JSON object")
    peft_type = data.get("peft_type")
    family = _PEFT_TYPES.get(peft_type) if isinstance(peft_type, str) else None
    if family is None:
        raise AdapterError(f"peft_type must be 'LORA', 'IA3' or 'FLORA', got {_quote(peft_type)}")
    task_type = data.get("task_type")
    if task_type not in (None, "CAUSAL_LM"):
        raise AdapterError(f"task_type must be 'CAUSAL_LM', got {_quote(task_type)}")
    if family == "lora" and data.get("use_dora"):
        family = "dora"
    if data.get("modules_to_save"):
        raise AdapterError(
            f"modules_to_save is not supported (the adapter trains full copies of "
            f"{_quote(data['modules_to_save'])}); only adapter weights can be served per request"
        )
    if data.get("bias", "none") != "none":
        raise AdapterError(f"bias={_quote(data['bias'])} is not supported; only bias='none'")
    if data.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out is not supported for Llama-family models")
    for key in _UNSUPPORTED_FEATURES:
        if data.get(key):
            raise AdapterError(f"the PEFT feature {key!r} is not supported")
    targets = TargetSpec.parse(data)
    base_model = data.get("base_model_name_or_path")
    base_model = base_model if isinstance(base_model, str) else None
    if family == "ia3":
        feedforward = data.get("feedforward_modules")
        feedforward = None if not feedforward else _feedforward(feedforward)
        return AdapterConfig(rank=0, alpha=0.0, use_rslora=False, targets=targets, rank_pattern={},
                             alpha_pattern={}, base_model_name=base_model, family=family,
                             feedforward_modules=feedforward)
    rank = data.get("r", 8)
    _check_rank(rank, "r", max_rank)
    if family == "flora":
        return AdapterConfig(rank=rank, alpha=float(rank), use_rslora=False, targets=targets,
                             rank_pattern={}, alpha_pattern={}, base_model_name=base_model,
                             family=family)
    alpha = data.get("lora_alpha", 8)
    if not _is_number(alpha) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"lora_alpha must be a positive finite number, got {_quote(alpha)}")
    rank_pattern = _pattern_dict(data.get("rank_pattern"), "rank_pattern")
    alpha_pattern = _pattern_dict(data.get("alpha_pattern"), "alpha_pattern")
    for key, value in rank_pattern.items():
        _check_rank(value, f"rank_pattern[{key!r}]", max_rank)
    for key, value in alpha_pattern.items():
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            raise AdapterError(f"alpha_pattern[{key!r}] must be a positive finite number")
    return AdapterConfig(
        rank=rank, alpha=float(alpha), use_rslora=bool(data.get("use_rslora", False)),
        targets=targets, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        base_model_name=base_model, family=family,
    )


def _feedforward(value: Any) -> tuple[str, ...] | str:
    if isinstance(value, str):
        if len(value) > MAX_PATTERN_LENGTH:
            raise AdapterError(f"feedforward_modules is longer than {MAX_PATTERN_LENGTH} characters")
        try:
            regex.compile(value)
        except regex.error as exc:
            raise AdapterError(f"feedforward_modules {_quote(value)} is not a valid regular "
                               f"expression ({exc})") from None
        return value
    if not isinstance(value, list) or len(value) > 64 or not all(
            isinstance(v, str) and 0 < len(v) <= MAX_PATTERN_LENGTH for v in value):
        raise AdapterError("feedforward_modules must be a regular expression or a list of module names")
    return tuple(value)


class RawTensor:
    """A tensor as stored in a safetensors file: dtype, shape and little-endian bytes."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], data: memoryview) -> None:
        self.name, self.dtype, self.shape, self.data = name, dtype, shape, data

    def values(self) -> np.ndarray:
        """The values as a float32 array."""
        np_dtype, _ = _DTYPES[self.dtype]
        array = np.frombuffer(self.data, dtype=np_dtype).reshape(self.shape)
        if self.dtype == "BF16":
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array.astype(np.float32)

    def update_digest(self, hasher: Any) -> None:
        hasher.update(f"{self.name};{self.dtype};{list(self.shape)};".encode())
        hasher.update(self.data)


def read_safetensors(path: str | Path, max_header_bytes: int = MAX_HEADER_BYTES,
                     name: str | None = None) -> dict[str, RawTensor]:
    """Parse a safetensors file, checking the header size, depth and JSON, dtypes, shapes and
    that the data offsets tile the data section exactly. Messages call the file `name`
    (default: the file's own name)."""
    path = Path(path)
    file = name or path.name
    data = path.read_bytes()
    if len(data) < 8:
        raise AdapterError(f"{file} is not a safetensors file (too short)")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > max_header_bytes:
        raise AdapterError(f"{file}: safetensors header of {header_len} bytes exceeds the "
                           f"{max_header_bytes}-byte limit")
    if 8 + header_len > len(data):
        raise AdapterError(f"{file} is not a safetensors file (header runs past the end)")
    try:
        header = loads_bounded(data[8:8 + header_len], MAX_HEADER_DEPTH)
    except ValueError as exc:
        raise AdapterError(f"{file} is not a safetensors file (header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{file}: safetensors header must be a JSON object")
    header.pop("__metadata__", None)
    if len(header) > MAX_TENSORS:
        raise AdapterError(f"{file} holds {len(header)} tensors, more than {MAX_TENSORS}")
    body = memoryview(data)[8 + header_len:]
    spans = [(*_tensor_info(file, tensor, info), tensor) for tensor, info in header.items()]
    promised = max((end for _, _, (_, end), _ in spans), default=0)
    if promised > len(body):
        raise AdapterError(f"{file} is truncated: its header promises {promised} bytes of tensor "
                           f"data and the file holds {len(body)}")
    position = 0
    tensors: dict[str, RawTensor] = {}
    for dtype, shape, (begin, end), tensor in sorted(spans, key=lambda span: span[2]):
        if begin != position:
            raise AdapterError(f"{file}: data of tensor {_quote(tensor)} does not follow the previous "
                               f"tensor (offset {begin}, expected {position})")
        position = end
        tensors[tensor] = RawTensor(tensor, dtype, shape, body[begin:end])
    if position != len(body):
        raise AdapterError(f"{file}: {len(body) - position} bytes of data after the last tensor belong "
                           f"to no tensor")
    return tensors


def _tensor_info(file: str, name: str, info: Any) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    where = f"{file}: tensor {_quote(name)}"
    if not isinstance(info, dict):
        raise AdapterError(f"{where}: its header entry is malformed")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES:
        raise AdapterError(f"{where} has dtype {_quote(dtype)}; allowed: F32, F16, BF16")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(isinstance(d, int) and 0 <= d < 2**31 for d in shape)):
        raise AdapterError(f"{where} has an invalid shape {_quote(shape)}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and 0 <= o < 2**63 for o in offsets)):
        raise AdapterError(f"{where} has invalid data_offsets {_quote(offsets)}")
    begin, end = offsets
    if end - begin != math.prod(shape) * _DTYPES[dtype][1]:
        raise AdapterError(f"{where}: data_offsets span {end - begin} bytes, but "
                           f"shape {shape} of {dtype} needs {math.prod(shape) * _DTYPES[dtype][1]}")
    return dtype, tuple(shape), (begin, end)


def _group_tensors(
    tensors: dict[str, RawTensor], config: AdapterConfig, base: BaseModelShape
) -> dict[tuple[int, str], dict[str, str]]:
    """(layer, module) -> {part: tensor name} (parts: A, B, M for DoRA's magnitude, L for IA3's
    vector), for exactly the modules the config targets in the base model, each with every part
    its family needs."""
    family = config.family
    expected = _PARTS[family]
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in tensors:
        match = _KEY.match(name)
        if match is None:
            raise AdapterError(_describe_unexpected(name))
        layer, block, module, suffix = int(match[1]), match[2], match[3], match[4]
        if module not in SUPPORTED_MODULES:
            raise AdapterError(f"unsupported target module {module!r} (tensor {name}); "
                               f"supported: {', '.join(SUPPORTED_MODULES)}")
        if block != block_of(module):
            raise AdapterError(f"tensor {name}: {module} belongs under {block_of(module)}, not {block}")
        if layer >= base.num_layers:
            raise AdapterError(f"tensor {name} is for layer {layer}, but the base model has "
                               f"{base.num_layers} layers")
        if suffix not in expected:
            raise AdapterError(_foreign_part(name, suffix, family))
        found.setdefault((layer, module), {})[expected[suffix]] = name
    _check_targets(set(found), config.targets, base.num_layers)
    names = {part: suffix for suffix, part in expected.items()}
    for (layer, module), parts in found.items():
        missing = sorted(set(names) - set(parts))
        if missing:
            raise AdapterError(f"layer {layer} {module} has no {names[missing[0]].removesuffix('.weight')} "
                               f"tensor")
    return found


def _foreign_part(name: str, suffix: str, family: str) -> str:
    """The message for a tensor that another family's adapters hold."""
    if suffix == "lora_magnitude_vector":
        return (f"tensor {_quote(name)} is a DoRA magnitude, but {CONFIG_NAME} does not set "
                f"use_dora: true")
    owner = {"ia3_l": "an IA3", "flora_A.weight": "a FLoRA", "flora_B.weight": "a FLoRA"}.get(
        suffix, "a LoRA")
    return f"tensor {_quote(name)} belongs in {owner} adapter, but {CONFIG_NAME} describes a {family} one"


def _check_targets(found: set[tuple[int, str]], targets: TargetSpec, num_layers: int) -> None:
    """The adapted modules must be those the config targets: PEFT saves a tensor pair for
    every module it adapts, and would load no others."""
    selected = targets.select(num_layers)
    extra, missing = sorted(found - selected), sorted(selected - found)
    if extra:
        raise AdapterError(f"{WEIGHTS_NAME} adapts {_modules(extra)}, which {CONFIG_NAME}'s "
                           f"{targets.describe()} does not select")
    if missing:
        raise AdapterError(f"{CONFIG_NAME}'s {targets.describe()} selects {_modules(missing)}, but "
                           f"{WEIGHTS_NAME} has no tensors for {'it' if len(missing) == 1 else 'them'}")


def _modules(keys: list[tuple[int, str]], limit: int = 4) -> str:
    named = [f"layer {layer} {module}" for layer, module in keys[:limit]]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(named) + more


def _describe_unexpected(name: str) -> str:
    if "lora_embedding" in name or "embed_tokens" in name:
        return "unsupported target module 'embed_tokens'; supported: " + ", ".join(SUPPORTED_MODULES)
    if "modules_to_save" in name or name.endswith(("lm_head.weight", "embed_tokens.weight")):
        return f"modules_to_save is not supported (tensor {_quote(name)})"
    match = re.search(r"\.([A-Za-z0-9_]+)\.lora_[AB]\.", name)
    if match:
        return (f"unsupported target module {_quote(match[1])} (tensor {_quote(name)}); "
                f"supported: {', '.join(SUPPORTED_MODULES)}")
    return f"unexpected tensor {_quote(name)} in {WEIGHTS_NAME}"


def _check_shapes(
    layer: int, module: str, a: RawTensor, b: RawTensor, config: AdapterConfig,
    base: BaseModelShape, max_rank: int,
) -> int:
    in_features, out_features = base.features(module)
    where = f"layer {layer} {module}"
    a_name, b_name = ("flora_A", "flora_B") if config.family == "flora" else ("lora_A", "lora_B")
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise AdapterError(f"{where}: {a_name} and {b_name} must be matrices")
    rank = a.shape[0]
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterError(
            f"{where}: shapes {a_name} {list(a.shape)} and {b_name} {list(b.shape)} do not fit the "
            f"base model, which needs {a_name} [r, {in_features}] and {b_name} [{out_features}, r]"
        )
    if b.shape[1] != rank:
        raise AdapterError(f"{where}: {a_name} has rank {rank} but {b_name} has rank {b.shape[1]}")
    _check_rank(rank, where, max_rank)
    return rank


def _check_rank(rank: Any, what: str, max_rank: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{what}: rank must be a positive integer, got {_quote(rank)}")
    if rank > max_rank:
        raise AdapterError(f"{what}: rank {rank} exceeds the limit of {max_rank} (max_lora_rank)")


def _pattern_dict(value: Any, what: str) -> dict[str, Any]:
    if not value:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise AdapterError(f"{what} must map module patterns to numbers")
    for key in value:
        # Module paths or their suffixes only: no regex metacharacters, so matching is linear.
        if len(key) > MAX_PATTERN_LENGTH or not _MODULE_PATH.fullmatch(key):
            raise AdapterError(f"{what} key {_quote(key)} must be a module name or dotted path")
    return dict(value)


def _pattern_key(patterns: dict[str, Any], module_path: str) -> str:
    """The first key that is `module_path` or a dotted suffix of it (PEFT's rule), else the path."""
    for key in patterns:
        if module_path == key or module_path.endswith("." + key):
            return key
    return module_path


def _quote(value: Any) -> str:
    """repr() of a value from a file, cut short."""
    text = repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS - 3] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
