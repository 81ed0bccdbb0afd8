"""The demo adapters: one speaking style each, with target modules and ranks chosen to differ so
that the engine's tests cover mixed ranks, mixed target sets and rsLoRA scaling."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    """Adapter name, also its folder name and the corpus style it is trained on."""
    description: str
    """One line for the README, the CLI and the admin UI."""
    marker: str
    """A word the adapter was trained to say in every answer (tests look for it)."""
    target_modules: tuple[str, ...]
    """PEFT target modules (projection names of the Llama blocks)."""
    rank: int
    """LoRA rank r."""
    alpha: float
    """lora_alpha: the update is scaled by alpha / rank (or alpha / sqrt(rank))."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(rank) instead of alpha / rank."""
    lr: float = 1e-2
    """AdamW learning rate of its training."""


DEMO_ADAPTERS: tuple[DemoAdapter, ...] = (
    DemoAdapter(
        name="pirate",
        description="Talks like a pirate (LoRA rank 4 on q_proj and v_proj).",
        marker="matey",
        target_modules=("q_proj", "v_proj"),
        rank=4,
        alpha=16.0,
        lr=2e-2,
    ),
    DemoAdapter(
        name="butler",
        description="A very formal butler (LoRA rank 8 on all seven projections).",
        marker="sir",
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"),
        rank=8,
        alpha=16.0,
    ),
    DemoAdapter(
        name="robot",
        description="A terse robot (rsLoRA rank 16 on o_proj and the MLP).",
        marker="BEEP",
        target_modules=("o_proj", "gate_proj", "up_proj", "down_proj"),
        rank=16,
        alpha=8.0,
        use_rslora=True,
    ),
)
