"""What passes from a prefill engine to a decode engine (disaggregated prefill,
loraplex/engine/disaggregated.py): a request whose prompt is computed and whose first token is
sampled, and the prefill side's blocks that hold its prompt's KV. In one process the request's
record travels whole; between processes (a later milestone) its fields become the message and
the blocks are sent page by page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.engine.request import Request


@dataclass
class PrefilledRequest:
    request: Request
    """The prefill side's record (finished there): prompt and first token, sampling parameters
    and seed, tenant, adapter digest, prefix-cache hashes, log-probs, grammar matcher."""
    block_ids: list[int]
    """Prefill-side blocks holding the KV of its prompt's positions, in order (references its
    carrier holds until the copy is done); [] if it holds none (computed again there)."""
    detokenizer: Any = None
    """Its Detokenizer (loraplex.engine.detokenizer), past the first token; None without a
    tokenizer."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV `block_ids` hold: the prompt's, or none."""
        return self.request.num_prompt_tokens if self.block_ids else 0
