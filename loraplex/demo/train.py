"""Training of the demo model and its adapters: AdamW at a constant learning rate over batches of
similar-length examples, on one CPU thread, from fixed seeds, so that a rebuild on the same
machine writes the same weights."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    """Seeds the base model's initialisation; adapter i is seeded with seed + 1 + i."""
    num_threads: int = 1
    """Torch CPU threads while training. Results depend on it (the order of float sums), so it
    is fixed; one thread is also the fastest when other processes share the cores."""
    batch_size: int = 16
    """Examples per step; each batch holds examples of similar length (little padding)."""
    base_epochs: int = 30
    """Passes over the base model's examples (all weights trained)."""
    base_lr: float = 3e-3
    """AdamW learning rate of the base model."""
    adapter_epochs: int = 20
    """Passes over each adapter's examples; adapters set their own learning rate
    (DemoAdapter.lr)."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this norm before each step."""


TRAIN = TrainSettings()


@contextmanager
def seeded(seed: int, num_threads: int) -> Iterator[None]:
    """Run the block with torch's CPU RNG seeded and `num_threads` threads, then restore both."""
    import torch

    saved_threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(saved_threads)


def fit(
    model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]], num_epochs: int,
    lr: float, max_grad_norm: float,
) -> float:
    """Train the parameters of `model` that require grad, one AdamW step per batch, the batches
    in a fresh random order each epoch. Returns the mean loss of the last epoch."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    for _ in range(num_epochs):
        losses = []
        for index in torch.randperm(len(batches)).tolist():
            loss = model(**batches[index]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    model.eval()
    return sum(losses) / max(len(losses), 1)
