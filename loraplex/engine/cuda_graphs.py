"""Decode steps on static buffers, captured as CUDA graphs at padded batch sizes.

A Triton launch costs about 19 us of host time and a decode step has hundreds of them; replayed
from a graph, a small kernel costs about 1 us. Everything a step changes (token ids, positions,
cache slots, block tables, sequence lengths, adapter slots, sampling parameters) is copied
into preallocated device tensors before replay; padding rows have sequence length 0 (attention
gives zeros), cache slot -1 (nothing stored), adapter slot 0 and the spare row of `row_tokens`.
An input token that is still on the device (PENDING) is read from `row_tokens`, where each
replay leaves the tokens it sampled. One graph per (padded batch
size, whether any token has an adapter, whether every row is greedy): a batch without
adapters launches no LoRA kernels, and an all-greedy batch takes an argmax instead of the
sampling kernel.

Without capture (CPU, or `use_cuda_graphs=False`) the same static-buffer path runs eagerly, so
its padding is tested where no GPU is present."""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.lora_weights import LoraSlotBuffers
from loraplex.kernels import Ops
from loraplex.model.context import AttentionMetadata, ForwardContext, LoraMetadata, forward_context
from loraplex.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8, up to max_batch (included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 8))
    return sizes + [max_batch]


@dataclass
class DecodeInputs:
    """A decode step's inputs for its `num_seqs` sequences, on the host."""

    rows: np.ndarray  # [num_seqs] int64: InputBatch rows
    input_ids: np.ndarray  # [num_seqs] int64, PENDING (-1) for a token still on the device
    positions: np.ndarray  # [num_seqs] int64
    slot_mapping: np.ndarray  # [num_seqs] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    token_slots: np.ndarray  # [num_seqs] int32
    temperature: np.ndarray  # [num_seqs] float32
    top_k: np.ndarray  # [num_seqs] int32
    top_p: np.ndarray  # [num_seqs] float32
    seeds: np.ndarray  # [num_seqs] int64
    offsets: np.ndarray  # [num_seqs] int64


class DecodeGraphRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: torch.Tensor, lora: LoraSlotBuffers, ops: Ops,
        row_tokens: torch.Tensor, max_batch: int, max_blocks_per_seq: int, capture: bool,
    ) -> None:
        """row_tokens [max_batch + 1] int64: the last token sampled for each row (the runner's)."""
        self.model, self.kv_cache, self.lora, self.ops = model, kv_cache, lora, ops
        self.row_tokens = row_tokens
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch, self.capture = max_batch, capture
        device = kv_cache.device
        P = max_batch
        # Per-step inputs, packed by dtype so a step is four copies from pinned host memory.
        self._packs = {
            "i64": torch.zeros(6, P, dtype=torch.int64, device=device),
            "i32": torch.zeros(3, P, dtype=torch.int32, device=device),
            "f32": torch.zeros(2, P, dtype=torch.float32, device=device),
            "blocks": torch.zeros(P, max_blocks_per_seq, dtype=torch.int32, device=device),
        }
        pin = device.type == "cuda"
        # Two sets of host packs, used in turn: with steps overlapped, the host fills the next
        # step's while the device may not yet have copied this step's. `_copied[i]` marks when
        # the device has read set i.
        self._host_sets = [
            {name: torch.zeros_like(t, device="cpu").pin_memory() if pin else torch.zeros_like(t)
             for name, t in self._packs.items()} for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        i64, i32, f32 = self._packs["i64"], self._packs["i32"], self._packs["f32"]
        self.input_ids, self.positions, self.slot_mapping, self.seeds, self.offsets, self.rows = i64
        self.seq_lens, self.token_slots, self.top_k = i32
        self.temperature, self.top_p = f32
        self.block_tables = self._packs["blocks"]
        self.query_start_loc = torch.arange(P + 1, dtype=torch.int32, device=device)
        # Outputs live in static buffers too, so the graphs' temporaries can share one pool.
        self.logits = torch.zeros(P, model.config.vocab_size, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(P, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def run(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [num_seqs, vocab] float32, sampled tokens [num_seqs]) of one decode step."""
        num_seqs = len(inputs.input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        self._fill(inputs, num_seqs, size)
        key = (size, bool(inputs.token_slots.any()), not inputs.temperature.any())
        if not self.capture:
            self._forward(*key)
        else:
            if key not in self._graphs:
                self._graphs[key] = self._capture(*key)
            self._graphs[key].replay()
        return self.logits[:num_seqs], self.tokens[:num_seqs]

    def _fill(self, inputs: DecodeInputs, n: int, size: int) -> None:
        """Write the step's inputs into rows :n and padding into rows n:size of the host packs,
        then copy each pack to the device (asynchronously on CUDA)."""
        self._turn ^= 1
        host = self._host_sets[self._turn]
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # long done in practice: two steps ago
        i64, i32, f32 = (host[k].numpy() for k in ("i64", "i32", "f32"))
        rows = (
            (i64[0], inputs.input_ids, 0), (i64[1], inputs.positions, 0), (i64[2], inputs.slot_mapping, -1),
            (i64[3], inputs.seeds, 0), (i64[4], inputs.offsets, 0), (i64[5], inputs.rows, self.max_batch),
            (i32[0], inputs.seq_lens, 0), (i32[1], inputs.token_slots, 0), (i32[2], inputs.top_k, 0),
            (f32[0], inputs.temperature, 0), (f32[1], inputs.top_p, 1),
        )
        for row, values, pad in rows:
            row[:n] = values
            row[n:size] = pad
        host["blocks"].numpy()[:n, :inputs.block_tables.shape[1]] = inputs.block_tables
        for name, device_pack in self._packs.items():
            device_pack.copy_(host[name], non_blocking=True)
        if self.capture:
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()

    def _forward(self, size: int, has_lora: bool, greedy: bool) -> None:
        attention = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            max_query_len=1,
        )
        lora = LoraMetadata(self.token_slots[:size], self.lora) if has_lora else None
        rows = self.rows[:size]
        with torch.inference_mode(), forward_context(ForwardContext(self.kv_cache, attention, lora)):
            input_ids = self.input_ids[:size]
            input_ids = torch.where(input_ids < 0, self.row_tokens[rows], input_ids)
            hidden = self.model(input_ids, self.positions[:size])
            logits = self.model.compute_logits(hidden)
            if greedy:
                tokens = self.ops.argmax(logits)
            else:
                tokens = self.ops.sample(
                    logits, self.temperature[:size], self.top_k[:size], self.top_p[:size],
                    self.seeds[:size], self.offsets[:size])
            self.logits[:size].copy_(logits)
            self.tokens[:size].copy_(tokens)
            self.row_tokens[rows] = tokens

    def _capture(self, size: int, has_lora: bool, greedy: bool) -> torch.cuda.CUDAGraph:
        # The warm-up runs on whatever the buffers hold: the current step's inputs (it stores
        # the same K/V that the replay then stores again) or padding (stores nothing). The
        # tokens it samples must not reach row_tokens, which the replay reads first.
        row_tokens = self.row_tokens.clone()
        self._forward(size, has_lora, greedy)  # compile every kernel before capture
        self.row_tokens.copy_(row_tokens)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(size, has_lora, greedy)
        logger.debug("captured decode graph: batch %d, lora %s, greedy %s", size, has_lora, greedy)
        return graph

    def capture_all(self) -> None:
        """Capture every graph up front (so no request waits on a capture)."""
        if not self.capture:
            return
        saved = self.slot_mapping.clone(), self.seq_lens.clone()
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        for size in reversed(self.sizes):
            for has_lora in (False, True):
                for greedy in (False, True):
                    key = (size, has_lora, greedy)
                    if key not in self._graphs:
                        self._graphs[key] = self._capture(*key)
        self.slot_mapping.copy_(saved[0])
        self.seq_lens.copy_(saved[1])
