"""transformers + PEFT, the reference that the engine is held to: a base model with several
PEFT adapters loaded under their names (for mixed batches through `adapter_names`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def peft_with_adapters(base: Any, folders: Mapping[str, str | Path]) -> Any:
    """A peft.PeftModel over transformers model `base` holding each PEFT adapter folder of
    `folders` under its name (`base` itself when there are none)."""
    from peft import PeftModel

    model = None
    for name, folder in folders.items():
        if model is None:
            model = PeftModel.from_pretrained(base, folder, adapter_name=name)
        else:
            model.load_adapter(folder, adapter_name=name)
    return base if model is None else model
