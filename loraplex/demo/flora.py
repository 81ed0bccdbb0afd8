"""FLoRA adapters with transformers: make one (wrap a model's projections, train it, save the
folder that loraplex serves) and the explicit reference that builds `W0 * (B A)` for each
adapted projection (the oracle the engine's batched path is tested against).

The format (docs/flora-format.md): a folder with `adapter_config.json`
(`{"peft_type": "FLORA", "r": 4, "target_modules": [...]}`, plus PEFT's optional
`exclude_modules`, `layers_to_transform`, `base_model_name_or_path`) and
`adapter_model.safetensors` holding, per adapted module,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.flora_A.weight` [r, in_features] and
`...flora_B.weight` [out_features, r]. The adapted weight is `W0 * (B @ A)`, element-wise; the
bias is unchanged.

    python -m loraplex.demo.flora OUT [--data-dir DIR] [--rank 4] [--style pirate]

trains one on the demo model (built or reused as `loraplex serve` does) to speak in a demo
adapter's style, and saves it to OUT."""

from __future__ import annotations

import argparse
import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loraplex.adapter_targets import TargetSpec, block_of

logger = logging.getLogger(__name__)

PEFT_TYPE = "FLORA"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_MODULES = ATTENTION + ("gate_proj", "up_proj", "down_proj")


class FloraLinear(nn.Module):
    """A frozen nn.Linear whose weight is multiplied element-wise by B @ A. Starts near W0:
    A = 1 and B = 1 / r, each with relative noise `init_noise` (which breaks the symmetry
    between the rank components)."""

    def __init__(self, base: nn.Linear, rank: int, init_noise: float = 0.02) -> None:
        super().__init__()
        self.base = base
        for param in base.parameters():
            param.requires_grad_(False)
        out_features, in_features = base.weight.shape
        self.flora_A = nn.Parameter(1 + init_noise * torch.randn(rank, in_features))
        self.flora_B = nn.Parameter((1 + init_noise * torch.randn(out_features, rank)) / rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.base.weight * (self.flora_B @ self.flora_A).to(self.base.weight.dtype)
        return nn.functional.linear(x, weight, self.base.bias)


def add_flora(model: Any, rank: int, target_modules: tuple[str, ...] = ATTENTION,
              init_noise: float = 0.02) -> Any:
    """A copy of a transformers Llama-family model with FloraLinear on `target_modules` of
    every layer; only the FLoRA parameters train."""
    model = copy.deepcopy(model)
    for param in model.parameters():
        param.requires_grad_(False)
    for layer in model.model.layers:
        for module in target_modules:
            parent = getattr(layer, block_of(module))
            setattr(parent, module, FloraLinear(getattr(parent, module), rank, init_noise))
    return model


def save_flora(model: Any, folder: str | Path, base_model_name: str | None = None) -> Path:
    """Write the FLoRA adapter of a model made by `add_flora` to `folder` (created)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, targets, rank = {}, set(), 0
    for i, layer in enumerate(model.model.layers):
        for module in ALL_MODULES:
            wrapped = getattr(getattr(layer, block_of(module)), module)
            if not isinstance(wrapped, FloraLinear):
                continue
            prefix = f"base_model.model.model.layers.{i}.{block_of(module)}.{module}"
            tensors[f"{prefix}.flora_A.weight"] = wrapped.flora_A.detach().float().contiguous()
            tensors[f"{prefix}.flora_B.weight"] = wrapped.flora_B.detach().float().contiguous()
            targets.add(module)
            rank = wrapped.flora_A.shape[0]
    if not tensors:
        raise ValueError("the model has no FLoRA modules (make it with add_flora)")
    config = {"peft_type": PEFT_TYPE, "r": rank, "target_modules": sorted(targets),
              "base_model_name_or_path": base_model_name, "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def merge_flora(model: Any, folder: str | Path) -> Any:
    """The explicit reference: a copy of `model` whose adapted projections hold
    W0 * (B @ A), built element by element from the saved folder (float32 products)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("peft_type") != PEFT_TYPE:
        raise ValueError(f"{folder} is not a FLoRA adapter")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    selected = TargetSpec.parse(config).select(len(model.model.layers))
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for i, module in sorted(selected):
            prefix = f"base_model.model.model.layers.{i}.{block_of(module)}.{module}"
            a, b = tensors[f"{prefix}.flora_A.weight"].float(), tensors[f"{prefix}.flora_B.weight"].float()
            linear = getattr(getattr(merged.model.layers[i], block_of(module)), module)
            linear.weight.copy_((linear.weight.float() * (b @ a)).to(linear.weight.dtype))
    return merged


def train_flora(base: Any, batches: list[dict[str, torch.Tensor]], rank: int,
                target_modules: tuple[str, ...], num_epochs: int, lr: float) -> tuple[Any, float]:
    """(the trained FLoRA model, the last epoch's mean loss): AdamW on A and B only."""
    from loraplex.demo.train import TRAIN, fit

    model = add_flora(base, rank, target_modules)
    loss = fit(model, batches, num_epochs, lr, TRAIN.max_grad_norm)
    return model, loss


def train_demo_flora(model_dir: Path, out: Path, rank: int = 4, style: str = "pirate",
                     target_modules: tuple[str, ...] = ATTENTION, num_epochs: int | None = None,
                     lr: float = 2e-2, seed: int = 0) -> float:
    """Train a FLoRA adapter on the demo model in `model_dir` to answer in `style` (a demo
    adapter's name) and save it to `out`. Returns the final loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplex.demo.examples import chat_examples, make_batches
    from loraplex.demo.train import TRAIN, seeded

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = chat_examples(tokenizer, style)
    with seeded(seed, TRAIN.num_threads):
        batches = make_batches(examples, TRAIN.batch_size, tokenizer.pad_token_id)
        model, loss = train_flora(base, batches, rank, target_modules,
                                  num_epochs or TRAIN.adapter_epochs, lr)
    save_flora(model, out, base_model_name=str(model_dir))
    logger.info("FLoRA adapter (%s, rank %d): %d examples, final loss %.4f", style, rank,
                len(examples), loss)
    return loss


def main(argv: list[str] | None = None) -> None:
    from loraplex.demo.assets import ensure_demo
    from loraplex.registry.registry_config import RegistryConfig

    parser = argparse.ArgumentParser(prog="python -m loraplex.demo.flora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to save the adapter to")
    parser.add_argument("--data-dir", type=Path, default=None, help="demo data folder")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--style", default="pirate", help="a demo adapter's style to learn")
    parser.add_argument("--all-modules", action="store_true", help="adapt all seven projections")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    assets = ensure_demo(RegistryConfig.resolve(data_dir=args.data_dir).data_dir)
    loss = train_demo_flora(assets.model_dir, args.out, args.rank, args.style,
                            ALL_MODULES if args.all_modules else ATTENTION)
    print(f"saved FLoRA adapter to {args.out} (final loss {loss:.4f})")


if __name__ == "__main__":
    main()
