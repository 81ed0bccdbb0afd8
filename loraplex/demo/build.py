"""Builds the demo: trains the tokenizer, the base model and every demo adapter, and saves them
as standard Hugging Face and PEFT folders where `DemoAssets` says. Not atomic on its own:
`ensure_demo` builds into a temporary folder and renames it into place."""

from __future__ import annotations

import copy
import json
import logging
import warnings
from pathlib import Path
from typing import Any

from loraplex.demo.assets import DemoAssets
from loraplex.demo.corpus import BASE_STYLE, TOPICS
from loraplex.demo.demo_adapters import DEMO_ADAPTERS, DemoAdapter
from loraplex.demo.demo_tokenizer import save_tokenizer, train_tokenizer
from loraplex.demo.examples import chat_examples, make_batches, text_examples
from loraplex.demo.model_config import DEMO_MODEL, make_llama_config
from loraplex.demo.train import TRAIN, fit, seeded

logger = logging.getLogger(__name__)


def build_demo(assets: DemoAssets) -> None:
    """Write the model folder and every adapter folder of `assets` (which must not exist)."""
    from transformers import AutoTokenizer

    model_dir = assets.model_dir
    model_dir.mkdir(parents=True)
    texts = [text for topic in TOPICS for text in (*topic.questions, *dict(topic.answers).values())]
    save_tokenizer(train_tokenizer(texts), model_dir, DEMO_MODEL.max_position_embeddings)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = _train_base(tokenizer)
    base.save_pretrained(model_dir, safe_serialization=True)
    for index, adapter in enumerate(DEMO_ADAPTERS):
        _train_adapter(base, tokenizer, adapter, index, assets.adapters[adapter.name])


def _train_base(tokenizer: Any) -> Any:
    from transformers import GenerationConfig, LlamaForCausalLM

    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    styles = [BASE_STYLE, *(adapter.name for adapter in DEMO_ADAPTERS)]
    examples = chat_examples(tokenizer, BASE_STYLE) + text_examples(tokenizer, styles)
    with seeded(TRAIN.seed, TRAIN.num_threads):
        model = LlamaForCausalLM(make_llama_config(DEMO_MODEL, len(tokenizer), **ids))
        batches = make_batches(examples, TRAIN.batch_size, tokenizer.pad_token_id)
        loss = fit(model, batches, TRAIN.base_epochs, TRAIN.base_lr, TRAIN.max_grad_norm)
    model.generation_config = GenerationConfig(**ids)
    logger.info("demo base model: %d examples, final loss %.4f", len(examples), loss)
    return model


def _train_adapter(base: Any, tokenizer: Any, adapter: DemoAdapter, index: int, out: Path) -> None:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        use_rslora=adapter.use_rslora,
        target_modules=list(adapter.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    examples = chat_examples(tokenizer, adapter.name)
    with seeded(TRAIN.seed + 1 + index, TRAIN.num_threads):
        with warnings.catch_warnings():
            # PEFT 0.21 asks transformers 5 for a property it has renamed.
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            model = get_peft_model(copy.deepcopy(base), config)
        batches = make_batches(examples, TRAIN.batch_size, tokenizer.pad_token_id)
        loss = fit(model, batches, TRAIN.adapter_epochs, adapter.lr, TRAIN.max_grad_norm)
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
    _sort_target_modules(out / "adapter_config.json")
    logger.info("demo adapter %s: %d examples, final loss %.4f", adapter.name, len(examples), loss)


def _sort_target_modules(path: Path) -> None:
    """PEFT writes target_modules from a set, in an order that varies between processes."""
    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
