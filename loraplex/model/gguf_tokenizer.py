"""A Hugging Face tokenizer (tokenizer.json, built with the `tokenizers` library, and
tokenizer_config.json with the chat template) from a GGUF file's vocabulary, merges and
metadata. Byte-level BPE (GGUF tokenizer model `gpt2`) with the pre-tokenizers of the
supported model families."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from loraplex.errors import ModelLoadError
from loraplex.model.gguf_file import GGUFFile

CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4
"""GGUF tokenizer.ggml.token_type values of special and added tokens."""

# Llama 3's split pattern (the tiktoken cl100k pattern with 1-3 digit numbers); Qwen2's splits
# every digit.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2() -> Any:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(pattern: str) -> Any:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt-2": _gpt2,
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_PATTERN),
    "qwen2": lambda: _split_then_bytes(_QWEN2_PATTERN),
}
"""GGUF tokenizer.ggml.pre -> the pre-tokenizer that splits text before BPE."""


def build_tokenizer(model: GGUFFile) -> Tokenizer:
    """The file's tokenizer (refused by name unless byte-level BPE with a known pre-tokenizer)."""
    kind = model.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{model.path.name}: unsupported tokenizer model {kind!r}; the GGUF import "
                             "supports byte-level BPE ('gpt2')")
    pre = model.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"{model.path.name}: unsupported pre-tokenizer {pre!r}; the GGUF import "
                             f"supports {', '.join(PRE_TOKENIZERS)}")
    tokens: list[str] = list(model.require("tokenizer.ggml.tokens"))
    types = list(model.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [_merge(line) for line in model.require("tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{model.path.name}: the vocabulary has duplicate tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, kind in enumerate(types) if kind == CONTROL_TOKEN])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, kind in enumerate(types) if kind == USER_DEFINED_TOKEN])
    bos_id = model.get("tokenizer.ggml.bos_token_id")
    if model.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def save_tokenizer(model: GGUFFile, folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (special tokens, chat template) into
    `folder`."""
    tokenizer = build_tokenizer(model)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokens = model.require("tokenizer.ggml.tokens")
    arch = model.require("general.architecture")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model.get(f"{arch}.context_length", 2048),
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(model.get("tokenizer.ggml.add_bos_token", False)),
    }
    for role, key in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"),
                      ("padding", "pad_token")):
        index = model.get(f"tokenizer.ggml.{role}_token_id")
        if index is not None and 0 <= index < len(tokens):
            config[key] = tokens[index]
    template = model.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _merge(line: str) -> tuple[str, str]:
    parts = line.split(" ")
    if len(parts) != 2:
        raise ModelLoadError(f"malformed BPE merge {line!r} in the GGUF tokenizer")
    return parts[0], parts[1]
