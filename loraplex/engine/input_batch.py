"""The model runner's own record of the requests it is running: one row per request in
preallocated arrays, updated from each step plan, so preparing a step costs work in proportion
to the step, not to the requests' lengths."""

from __future__ import annotations

import numpy as np

from loraplex.engine.plan import NewSequence


class InputBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.tokens: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_dropped = np.zeros(max_num_seqs, dtype=np.int64)
        """Tokens a sliding window dropped (attention sinks): a token's position in the cache is
        its position in the text less these, once past the sinks."""
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.adapter_slot = np.zeros(max_num_seqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.seed = np.zeros(max_num_seqs, dtype=np.int64)
        self.logprobs = np.full(max_num_seqs, -1, dtype=np.int32)
        self.prompt_logprobs = np.full(max_num_seqs, -1, dtype=np.int32)
        self.num_scoring_rows = 0
        """Rows that asked for prompt logprobs (0: a step need not look for positions to score)."""

    def add(self, seq: NewSequence) -> int:
        if seq.request_id in self.row_of:
            raise ValueError(f"request {seq.request_id} is already in the batch")
        row = self._free_rows.pop()
        self.row_of[seq.request_id] = row
        self.tokens[row] = list(seq.token_ids)
        self.num_prompt_tokens[row] = seq.num_prompt_tokens
        self.num_computed[row] = seq.num_computed_tokens
        self.num_dropped[row] = seq.num_dropped_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, seq.block_ids)
        self.adapter_slot[row] = seq.adapter_slot
        p = seq.params
        self.temperature[row] = p.temperature
        self.top_k[row] = min(p.top_k, 2**31 - 1)  # any k past the vocabulary means "off"
        self.top_p[row] = p.top_p
        self.seed[row] = seq.seed
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.num_scoring_rows += p.prompt_logprobs is not None
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.tokens[row] = []
            self._free_rows.append(row)
            self.num_scoring_rows -= bool(self.prompt_logprobs[row] >= 0)
            self.prompt_logprobs[row] = -1

    def num_tokens_of(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows)] int64: tokens each row holds (prompt, generated, pending)."""
        return np.fromiter((len(self.tokens[r]) for r in rows.tolist()), np.int64, len(rows))

    def drop_blocks(self, row: int, first: int, count: int, block_size: int) -> np.ndarray:
        """Drop `count` blocks from index `first` of a row's table (attention sinks); those after
        move up. Returns the blocks that moved [num_blocks - first] (int32)."""
        end = self.num_blocks[row]
        table = self.block_table[row]
        table[first:end - count] = table[first + count:end].copy()
        self.num_blocks[row] = end - count
        self.num_dropped[row] += count * block_size
        return table[first:end - count].copy()

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)
