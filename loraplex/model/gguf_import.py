"""`import_gguf`: a GGUF file (llama.cpp's format) as a Hugging Face model folder that loraplex
serves: config.json, bf16 safetensors (sharded past MAX_SHARD_BYTES), tokenizer.json and
tokenizer_config.json with the chat template.

Everything is checked (architecture, tensor types and names, tokenizer) before a byte is
written; the folder is built under a temporary name beside the destination and renamed into
place only when complete, so an error or a kill leaves nothing half-written."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loraplex.errors import ModelLoadError
from loraplex.model.gguf_config import gguf_config
from loraplex.model.gguf_file import GGUFFile, open_gguf
from loraplex.model.gguf_tensors import check_tensor_types, hf_tensors
from loraplex.model.gguf_tokenizer import build_tokenizer, save_tokenizer
from loraplex.model.model_config import ModelConfig

MAX_SHARD_BYTES = 4 << 30
"""Safetensors files hold at most this many bytes of tensors; a larger model is sharded."""
SOURCE_FILE = "gguf-source.json"
"""Written last into an imported folder: the GGUF file it came from (path, size, mtime)."""
STAGING_PREFIX = ".gguf-import-"
OUT_DTYPE = torch.bfloat16

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImportedModel:
    folder: Path
    name: str
    """The model's id (config.json `_name_or_path`)."""
    num_params: int


def import_gguf(path: str | Path, out: str | Path, *, name: str | None = None,
                show_progress: bool = True) -> ImportedModel:
    """Convert the GGUF file `path` into the new folder `out` (which must not exist). `name`
    overrides the model's id (default: the GGUF's general.name)."""
    model = open_gguf(path)
    out = Path(out).expanduser().resolve()
    if out.exists():
        raise ModelLoadError(f"{out} already exists; choose another --out or remove it")
    config = gguf_config(model, name)
    ModelConfig.from_dict(config)  # what the loader would refuse is refused now
    check_tensor_types(model)
    build_tokenizer(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out.parent))
    try:
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", {
            key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
            if config.get(key) is not None})
        save_tokenizer(model, staging)
        num_params = _write_weights(model, staging, show_progress)
        _write_json(staging / SOURCE_FILE, source_stamp(model.path, name))
        _fsync_tree(staging)
        staging.chmod(0o755)  # mkdtemp made it private
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("imported %s (%s, %.1fM parameters) into %s", model.path.name, config["_name_or_path"],
                num_params / 1e6, out)
    return ImportedModel(folder=out, name=config["_name_or_path"], num_params=num_params)


def import_cached(path: str | Path, cache_dir: str | Path, *, name: str | None = None,
                  show_progress: bool = True) -> Path:
    """The import of `path` in `cache_dir/<file stem>/`, made first if it is missing or came
    from another file (another path, size or mtime) or with another name."""
    path = Path(path).expanduser().resolve()
    folder = Path(cache_dir).expanduser().resolve() / path.stem
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist or is not a file")
    stamp = source_stamp(path, name)
    try:
        if json.loads((folder / SOURCE_FILE).read_text()) == stamp:
            return folder
    except (OSError, ValueError):
        pass
    logger.info("importing %s into %s (once; later starts reuse it)", path, folder)
    fresh = folder.with_name(f"{STAGING_PREFIX}{folder.name}-{os.getpid()}")
    for leftover in folder.parent.glob(STAGING_PREFIX + "*"):  # of an import that was killed
        shutil.rmtree(leftover, ignore_errors=True)
    import_gguf(path, fresh, name=name, show_progress=show_progress)
    if folder.exists():
        shutil.rmtree(folder)
    fresh.rename(folder)
    return folder


def source_stamp(path: Path, name: str | None = None) -> dict[str, Any]:
    """What identifies an import for the cache: the GGUF file's resolved path, size and mtime,
    and the name asked for."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "name": name}


def _write_weights(model: GGUFFile, folder: Path, show_progress: bool) -> int:
    """Dequantize every tensor into safetensors shards; returns the number of parameters."""
    from tqdm import tqdm

    sizes = [int(t.n_elements) * OUT_DTYPE.itemsize for t in model.tensors]
    num_shards = _num_shards(sizes)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, weight_map, num_params = 0, {}, 0
    total = sum(int(t.n_elements) for t in model.tensors)
    with tqdm(total=total, unit="param", unit_scale=True, desc=f"importing {model.path.name}",
              disable=not show_progress) as progress:
        for (name, tensor), size in zip(hf_tensors(model, OUT_DTYPE), sizes):
            if shard and shard_bytes + size > MAX_SHARD_BYTES:
                _save_shard(shard, folder, len(set(weight_map.values())) + 1, num_shards, weight_map)
                shard, shard_bytes = {}, 0
            shard[name], shard_bytes = tensor, shard_bytes + size
            num_params += tensor.numel()
            progress.update(tensor.numel())
        _save_shard(shard, folder, len(set(weight_map.values())) + 1, num_shards, weight_map)
    if num_shards > 1:
        _write_json(folder / "model.safetensors.index.json",
                    {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map})
    return num_params


def _num_shards(sizes: list[int]) -> int:
    count, current = 1, 0
    for size in sizes:
        if current and current + size > MAX_SHARD_BYTES:
            count, current = count + 1, 0
        current += size
    return count


def _save_shard(tensors: dict[str, torch.Tensor], folder: Path, index: int, num_shards: int,
                weight_map: dict[str, str]) -> None:
    file = "model.safetensors" if num_shards == 1 else f"model-{index:05d}-of-{num_shards:05d}.safetensors"
    save_file(tensors, str(folder / file), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, file))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        path.chmod(0o644)
        with open(path, "rb") as file:
            os.fsync(file.fileno())
