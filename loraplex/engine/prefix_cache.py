"""Identity of full KV blocks for the prefix cache: a hash chained over the blocks of a
prompt, seeded by who computes them. Pure Python.

Block i's hash covers (tenant, adapter digest or "base", block i-1's hash, block i's tokens),
so two blocks with one hash hold the same KV: the same tokens after the same prefix, under the
same weights. The tenant is part of the seed on purpose: no tenant can learn from its time to
first token that another tenant sent some prompt (vLLM added `cache_salt` for this). The
adapter is its content digest, never its name: a same-name reload must not hit stale KV."""

from __future__ import annotations

import hashlib
import json

import numpy as np

BASE_MODEL = "base"
"""The adapter part of the seed for requests without an adapter."""


def block_hashes(token_ids: list[int], block_size: int, tenant: str, adapter: str | None,
                 num_blocks: int | None = None) -> list[bytes]:
    """Chained hashes of the first `num_blocks` full blocks of `token_ids` (default: all full
    blocks)."""
    count = len(token_ids) // block_size if num_blocks is None else num_blocks
    tokens = np.asarray(token_ids[:count * block_size], dtype=np.int64)
    # JSON keeps (tenant, adapter) unambiguous whatever characters a name holds.
    previous = hashlib.sha256(json.dumps([tenant, adapter or BASE_MODEL]).encode()).digest()
    hashes = []
    for i in range(count):
        previous = hashlib.blake2b(previous + tokens[i * block_size:(i + 1) * block_size].tobytes(),
                                   digest_size=16).digest()
        hashes.append(previous)
    return hashes
