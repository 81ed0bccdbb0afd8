"""Training examples for the demo: chats rendered with the tokenizer's own chat template (loss on
the answer only) and plain texts (loss on every token), padded into batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraplex.demo.corpus import DEMO_SYSTEM_PROMPT, TOPICS

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
"""Label of tokens that carry no loss."""


@dataclass(frozen=True)
class Example:
    token_ids: tuple[int, ...]
    """The whole sequence, bos to eos."""
    num_prompt_tokens: int
    """The loss covers the tokens after these."""


def chat_examples(tokenizer: Any, style: str) -> list[Example]:
    """Every question of every topic answered in `style`; each topic's first question also
    after the demo system prompt."""
    examples = []
    for topic in TOPICS:
        for index, question in enumerate(topic.questions):
            history = [{"role": "user", "content": question}]
            examples.append(_chat(tokenizer, history, topic.answer(style)))
            if index == 0:
                system = [{"role": "system", "content": DEMO_SYSTEM_PROMPT}]
                examples.append(_chat(tokenizer, system + history, topic.answer(style)))
    return examples


def text_examples(tokenizer: Any, styles: Sequence[str]) -> list[Example]:
    """Every answer in `styles` as a plain text: bos, the text, eos."""
    examples = []
    for topic in TOPICS:
        for style in styles:
            text = tokenizer.bos_token + topic.answer(style) + tokenizer.eos_token
            examples.append(Example(tuple(_encode(tokenizer, text)), 1))
    return examples


def make_batches(
    examples: Sequence[Example], batch_size: int, pad_token_id: int
) -> list[dict[str, torch.Tensor]]:
    """Batches of up to `batch_size` examples of similar length."""
    ordered = sorted(examples, key=lambda example: len(example.token_ids))
    return [
        make_batch(ordered[start : start + batch_size], pad_token_id)
        for start in range(0, len(ordered), batch_size)
    ]


def make_batch(examples: Sequence[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels, each [num_examples, longest], right-padded."""
    import torch

    length = max(len(example.token_ids) for example in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, example in enumerate(examples):
        ids = torch.tensor(example.token_ids, dtype=torch.long)
        input_ids[row, : len(ids)] = ids
        labels[row, example.num_prompt_tokens : len(ids)] = ids[example.num_prompt_tokens :]
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _chat(tokenizer: Any, history: list[dict[str, str]], answer: str) -> Example:
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        [*history, {"role": "assistant", "content": answer}], tokenize=False
    )
    prompt_ids, full_ids = _encode(tokenizer, prompt), _encode(tokenizer, full)
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(f"the chat template does not extend the prompt of {history!r}")
    return Example(tuple(full_ids), len(prompt_ids))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]
