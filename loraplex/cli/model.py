"""`loraplex model import FILE.gguf [--out DIR] [--name ID]`: a GGUF file (llama.cpp's format)
as a Hugging Face model folder that `loraplex serve --model DIR` serves."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("model", help="base model files")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    importer = actions.add_parser("import", help="convert a GGUF file into a model folder (bf16 "
                                  "safetensors, config, tokenizer)")
    importer.add_argument("file", metavar="FILE.gguf")
    importer.add_argument("--out", metavar="DIR", help="the new folder (default: the file's name "
                          "without .gguf, in the current directory)")
    importer.add_argument("--name", metavar="ID", help="the model's id when served (default: the "
                          "GGUF's general.name)")
    importer.set_defaults(run=run_import)


def run_import(args: argparse.Namespace) -> None:
    from loraplex.model.gguf_import import import_gguf

    source = Path(args.file)
    out = Path(args.out) if args.out else Path.cwd() / source.stem
    imported = import_gguf(source, out, name=args.name)
    print(f"imported {source.name} as {imported.name!r} ({imported.num_params / 1e6:.1f}M parameters, "
          f"bf16) into {imported.folder}")
