"""Open a GGUF file (llama.cpp's format) with the `gguf` library, turning its low-level errors
(a wrong magic number, a truncated header or tensor, an unknown tensor type) into one clear
ModelLoadError that names the file."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file whose header, metadata and tensor table have been read and checked."""

    path: Path
    metadata: dict[str, Any]
    """Every key-value field (`general.name`, `llama.block_count`, `tokenizer.ggml.tokens`, ...)."""
    tensors: list[Any]
    """gguf.ReaderTensor: name, tensor_type, shape (GGML order, fastest dimension first), data."""

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelLoadError(f"{self.path.name}: the GGUF metadata has no {key}")
        return self.metadata[key]


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic number (or is named *.gguf)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == GGUF_SUFFIX:
        return True
    with open(path, "rb") as file:
        return file.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def open_gguf(path: str | Path) -> GGUFFile:
    """Read the file's metadata and tensor table (tensor data stays memory-mapped)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist or is not a file")
    with open(path, "rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
    try:
        reader = gguf.GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items()}
        tensors = list(reader.tensors)
    except (ValueError, IndexError, TypeError, OverflowError) as exc:
        unknown_type = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
        if unknown_type:
            raise ModelLoadError(f"{path} has a tensor of unknown GGML type {unknown_type.group(1)} "
                                 "(corrupt, or newer than this gguf library)") from None
        raise ModelLoadError(f"{path} is not a complete GGUF file (truncated or corrupt): {exc}") from None
    size = path.stat().st_size
    for tensor in tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ModelLoadError(f"{path} is truncated: tensor {tensor.name} ends past the end of the file")
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)
