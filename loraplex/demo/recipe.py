"""The identity of the demo recipe: a digest of the source of this package, which holds all that
decides the built files (model shape, tokenizer, corpus, adapters, training). A built demo whose
stamp holds another digest is rebuilt, so any change to the recipe rebuilds without anyone
having to remember a version number."""

from __future__ import annotations

import hashlib
from pathlib import Path


def recipe_digest(package_dir: Path = Path(__file__).parent) -> str:
    """sha256 (hex) of the names and contents of the Python files in `package_dir` (default:
    this package's)."""
    hasher = hashlib.sha256()
    for path in sorted(package_dir.glob("*.py")):
        source = path.read_bytes().replace(b"\r\n", b"\n")
        hasher.update(f"{path.name}:{len(source)}:".encode())
        hasher.update(source)
    return hasher.hexdigest()
