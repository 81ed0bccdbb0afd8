"""Greedy answers of the built demo through transformers + PEFT (the reference that the engine is
held to): for `python -m loraplex.demo`, the README and the tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.demo.assets import DemoAssets


@dataclass(frozen=True)
class DemoModel:
    """The demo base model with every demo adapter loaded, and its tokenizer."""

    model: Any
    """A peft.PeftModel over a transformers LlamaForCausalLM, in eval mode."""
    tokenizer: Any
    """The transformers tokenizer of the model folder."""


def load_demo_model(assets: DemoAssets) -> DemoModel:
    """Load the base model and every adapter of `assets` (float32, CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplex.peft_reference import peft_with_adapters

    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    base = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    model = peft_with_adapters(base, assets.adapters).eval()
    return DemoModel(model, tokenizer)


def greedy_answer(
    demo: DemoModel, prompt: str, adapter: str | None = None, max_new_tokens: int = 64,
    system_prompt: str | None = None,
) -> str:
    """The greedy reply to one user message, through `adapter` (None: the base model)."""
    import torch

    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    tokenizer = demo.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        if adapter is None:
            with demo.model.disable_adapter():
                output = _generate(demo.model, input_ids, max_new_tokens, tokenizer)
        else:
            demo.model.set_adapter(adapter)
            output = _generate(demo.model, input_ids, max_new_tokens, tokenizer)
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def _generate(model: Any, input_ids: Any, max_new_tokens: int, tokenizer: Any) -> Any:
    return model.generate(
        input_ids=input_ids,
        attention_mask=input_ids.new_ones(input_ids.shape),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
