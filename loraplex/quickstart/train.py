"""Training of the quick start's adapters with PEFT on CPU: LoRA on every projection of the top
layers only (the layers below need no backward pass, which makes a step about half as dear),
the loss on the reply's tokens only (logits are computed for those alone), AdamW at a constant
learning rate, from a fixed seed."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.quickstart.tasks import Example, Task


@dataclass(frozen=True)
class TrainSettings:
    rank: int = 8
    """LoRA rank r."""
    alpha: float = 16.0
    """lora_alpha (the update is scaled by alpha / rank)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                       "up_proj", "down_proj")
    num_top_layers: int = 10
    """LoRA goes on the top this many decoder layers."""
    num_steps: int = 12
    """Optimizer steps per adapter."""
    batch_size: int = 4
    """Examples per step, taken from the training set in turn."""
    lr: float = 3e-3
    """AdamW learning rate."""
    seed: int = 0
    num_threads: int = 1
    """Torch CPU threads while training."""


TRAIN = TrainSettings()


def train_adapter(base: Any, tokenizer: Any, task: Task, settings: TrainSettings, out: Path,
                  on_step: Callable[[float], None] = lambda loss: None) -> float:
    """Train a LoRA adapter for `task` on a copy of `base` (a transformers causal LM in float32)
    and save it as a PEFT folder in `out`. Calls `on_step(loss)` after each step; returns the
    last step's loss."""
    import torch
    from peft import LoraConfig, get_peft_model

    from loraplex.demo.train import seeded

    num_layers = base.config.num_hidden_layers
    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.target_modules),
        layers_to_transform=list(range(max(num_layers - settings.num_top_layers, 0), num_layers)),
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    with seeded(settings.seed, settings.num_threads):
        with warnings.catch_warnings():
            # PEFT 0.21 asks transformers 5 for a property it has renamed.
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            model = get_peft_model(copy.deepcopy(base), config)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
        model.train()
        loss_value = float("nan")
        for step in range(settings.num_steps):
            batch = [task.train[(step * settings.batch_size + i) % len(task.train)]
                     for i in range(settings.batch_size)]
            loss = reply_loss(model, tokenizer, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = loss.item()
            on_step(loss_value)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    adapter_config["target_modules"] = sorted(adapter_config["target_modules"])  # PEFT writes a set
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
    return loss_value


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The token ids of one user message in the model's chat template, as the server makes them."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def reply_loss(model: Any, tokenizer: Any, batch: Sequence[Example]) -> Any:
    """Mean cross-entropy of each example's reply (and the end-of-turn token) after its prompt.
    Examples are padded on the left, so that every reply ends the row and only the last
    `max reply length` positions need logits."""
    import torch

    pairs = [(chat_prompt_ids(tokenizer, ex.prompt),
              tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
             for ex in batch]
    length = max(len(prompt) + len(reply) for prompt, reply in pairs)
    num_reply = max(len(reply) for _, reply in pairs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # [batch, length]
    input_ids = torch.tensor([[pad] * (length - len(p) - len(r)) + p + r for p, r in pairs])
    mask = torch.tensor([[0] * (length - len(p) - len(r)) + [1] * (len(p) + len(r)) for p, r in pairs])
    labels = torch.tensor([[-100] * (num_reply - len(r)) + r for _, r in pairs])  # [batch, num_reply]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                   logits_to_keep=num_reply + 1).logits[:, :-1]  # [batch, num_reply, vocab]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)
