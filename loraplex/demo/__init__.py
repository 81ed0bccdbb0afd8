"""The built-in demo: a tiny Llama-shaped model with a byte-level BPE tokenizer and a few PEFT
LoRA adapters, each with its own voice, trained on the spot in seconds on CPU and built once
into `<data_dir>/demo/`. `loraplex serve` without `--model`, the README and the tests use it.

    from loraplex.demo import DEMO_ADAPTERS, DEMO_PROMPT, ensure_demo
    assets = ensure_demo(data_dir)   # assets.model_dir, assets.adapters["pirate"], ...
"""

from loraplex.demo.assets import DemoAssets, ensure_demo
from loraplex.demo.corpus import DEMO_PROMPT, DEMO_SYSTEM_PROMPT
from loraplex.demo.demo_adapters import DEMO_ADAPTERS, DemoAdapter

__all__ = [
    "DEMO_ADAPTERS", "DEMO_PROMPT", "DEMO_SYSTEM_PROMPT", "DemoAdapter", "DemoAssets", "ensure_demo",
]
