"""The identity of the demo recipe: a digest of everything that decides the built files (model
shape, tokenizer, corpus, adapters, training settings). A built demo whose stamp holds another
digest is rebuilt."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from loraplex.demo.adapters import DEMO_ADAPTERS
from loraplex.demo.corpus import DEMO_SYSTEM_PROMPT, TOPICS
from loraplex.demo.model_config import DEMO_MODEL
from loraplex.demo.tokenizer import CHAT_TEMPLATE, MIN_FREQUENCY, SPECIAL_TOKENS, VOCAB_SIZE
from loraplex.demo.train import TRAIN

RECIPE_VERSION = 1
"""Bump when the build code changes what it writes in a way the digest cannot see."""


def recipe_digest() -> str:
    """sha256 (hex) of the recipe."""
    recipe = {
        "version": RECIPE_VERSION,
        "model": asdict(DEMO_MODEL),
        "tokenizer": {
            "vocab_size": VOCAB_SIZE,
            "min_frequency": MIN_FREQUENCY,
            "special_tokens": SPECIAL_TOKENS,
            "chat_template": CHAT_TEMPLATE,
        },
        "corpus": {"topics": [asdict(topic) for topic in TOPICS], "system": DEMO_SYSTEM_PROMPT},
        "adapters": [asdict(adapter) for adapter in DEMO_ADAPTERS],
        "train": asdict(TRAIN),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
