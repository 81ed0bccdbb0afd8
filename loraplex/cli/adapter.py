"""`loraplex adapter upload --tenant NAME --name ADAPTER DIR [--model DIR]`,
`loraplex adapter list [--tenant NAME]`, `loraplex adapter rm --tenant NAME ADAPTER`."""

from __future__ import annotations

import argparse
from pathlib import Path

from loraplex.cli.common import add_registry_options, open_registry, print_table
from loraplex.engine_config import LoRAConfig
from loraplex.errors import ModelLoadError
from loraplex.registry import Registry
from loraplex.registry.records import ServedModelRecord
from loraplex.registry.registry_errors import BaseModelUnknownError


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("adapter", help="LoRA adapters")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    upload = actions.add_parser("upload", help="validate and store a PEFT adapter folder")
    upload.add_argument("--tenant", required=True, metavar="NAME")
    upload.add_argument("--name", required=True, metavar="ADAPTER")
    upload.add_argument("dir", metavar="DIR", help="adapter_config.json + "
                        "adapter_model.safetensors")
    upload.add_argument("--model", metavar="DIR", help="check against this Hugging Face model "
                        "folder's config.json when the registry records no served model")
    add_registry_options(upload)
    upload.set_defaults(run=run_upload)
    listing = actions.add_parser("list", help="list adapters")
    listing.add_argument("--tenant", metavar="NAME")
    add_registry_options(listing)
    listing.set_defaults(run=run_list)
    remove = actions.add_parser("rm", help="delete an adapter")
    remove.add_argument("--tenant", required=True, metavar="NAME")
    remove.add_argument("name", metavar="ADAPTER")
    add_registry_options(remove)
    remove.set_defaults(run=run_remove)


def run_upload(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        model = served_model(registry, args.model)
        adapter = registry.adapters.upload_dir(args.tenant, args.name, args.dir, model=model)
    print(f"uploaded adapter {adapter.name} for tenant {adapter.tenant}: {adapter.family} "
          f"rank {adapter.rank}, "
          f"targets {','.join(adapter.target_modules)}, {adapter.size_bytes} bytes, "
          f"digest {adapter.digest}")


def run_list(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        adapters = registry.adapters.list(args.tenant)
    print_table(
        ("TENANT", "NAME", "RANK", "FAMILY", "ALPHA", "TARGETS", "BYTES", "DIGEST", "REQUESTS", "CREATED"),
        [(a.tenant, a.name, a.rank, a.family, a.alpha, a.target_modules, a.size_bytes, a.digest[:16],
          a.num_requests_served, a.created_at) for a in adapters],
    )


def run_remove(args: argparse.Namespace) -> None:
    with open_registry(args) as registry:
        registry.adapters.delete(args.tenant, args.name)
    print(f"removed adapter {args.name} of tenant {args.tenant}")


def served_model(registry: Registry, model_dir: str | None) -> ServedModelRecord:
    """The recorded served model; else the one in `model_dir`. A `model_dir` that does not
    match the recorded model is refused rather than silently ignored."""
    recorded = registry.models.get()
    local = None if model_dir is None else model_from_folder(Path(model_dir))
    if recorded is not None:
        if local is not None and local.shape != recorded.shape:
            raise BaseModelUnknownError(
                f"--model {model_dir} does not have the shape of the served base model "
                f"{recorded.model_id!r} recorded in the registry")
        return recorded
    if local is None:
        raise BaseModelUnknownError(
            "no served base model is recorded in the registry and no --model DIR was given: "
            "start `loraplex serve` once, or pass --model with the base model's folder")
    return local


def model_from_folder(folder: Path) -> ServedModelRecord:
    """A served-model record from a Hugging Face model folder's config.json."""
    from loraplex.model.model_config import ModelConfig

    try:
        shape = ModelConfig.load(folder).shape
    except (KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{folder / 'config.json'} is not a usable model config ({exc!r})") from None
    return ServedModelRecord(model_id=folder.resolve().name, shape=shape,
                             max_lora_rank=LoRAConfig().max_lora_rank)
