"""The base model's tokenizer and chat template, through transformers' AutoTokenizer from the
local folder (never from a hub)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from loraplex.errors import ModelLoadError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(folder: str | Path) -> Any | None:
    """The folder's tokenizer, or None when it has no tokenizer files (requests must then give
    token ids)."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files: prompts must be given as token ids", folder)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {exc}") from exc
