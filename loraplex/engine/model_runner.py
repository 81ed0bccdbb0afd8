"""Turns a step plan into tensors, runs the model and samples. Owns the KV cache, the LoRA
slot buffers and its own per-request arrays (InputBatch); never touches scheduler state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.input_batch import InputBatch
from loraplex.engine.lora_weights import HostAdapter, LoraSlotBuffers
from loraplex.engine.plan import StepPlan, StepResult
from loraplex.kernels import Ops
from loraplex.model.context import AttentionMetadata, ForwardContext, LoraMetadata, forward_context
from loraplex.model.llama import LlamaForCausalLM
from loraplex.types import TokenLogprob


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attention: AttentionMetadata
    token_slots: torch.Tensor | None  # [num_tokens], None when no token has an adapter
    logits_indices: torch.Tensor  # [num_samples]: rows of the hidden states that sample
    sample_rows: np.ndarray  # [num_samples]: InputBatch rows of the sampling requests


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: torch.Tensor, lora: LoraSlotBuffers, ops: Ops,
        max_num_seqs: int, max_blocks_per_seq: int, host_adapter: Callable[[str], HostAdapter],
    ) -> None:
        self.model, self.kv_cache, self.lora, self.ops = model, kv_cache, lora, ops
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]
        self.batch = InputBatch(max_num_seqs, max_blocks_per_seq)
        self._host_adapter = host_adapter

    def execute(self, plan: StepPlan) -> StepResult:
        self._apply(plan)
        if plan.is_empty:
            return StepResult()
        inputs = self.prepare(plan)
        lora = None if inputs.token_slots is None else LoraMetadata(inputs.token_slots, self.lora)
        context = ForwardContext(self.kv_cache, inputs.attention, lora)
        with torch.inference_mode(), forward_context(context):
            hidden = self.model(inputs.input_ids, inputs.positions)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            tokens = self._sample(logits, inputs.sample_rows)
            result = self._result(plan, logits, inputs.sample_rows, tokens)
        self._advance(plan, inputs.sample_rows, result.sampled_tokens)
        return result

    def _apply(self, plan: StepPlan) -> None:
        """Bring the runner's records up to date with the plan."""
        batch = self.batch
        for request_id in plan.forgotten_ids:
            batch.remove(request_id)
        for seq in plan.new:
            batch.add(seq)
        for request_id, block_ids in plan.new_block_ids.items():
            batch.append_blocks(batch.row_of[request_id], block_ids)
        for slot, digest in plan.adapter_loads:
            self.lora.load(slot, self._host_adapter(digest))

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Flat input tensors and attention/LoRA metadata for the scheduled requests."""
        batch, bs = self.batch, self.block_size
        row_of = batch.row_of
        rows = np.fromiter((row_of[r] for r in plan.request_ids), np.int64, len(plan.request_ids))
        num_new = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        start = batch.num_computed[rows]
        seq_lens = start + num_new
        max_query_len = int(num_new.max())
        if max_query_len == 1:
            token_rows, positions = rows, start
            input_ids = [batch.tokens[r][p] for r, p in zip(rows.tolist(), start.tolist())]
        else:
            token_rows = np.repeat(rows, num_new)
            positions = np.repeat(start - query_start[:-1], num_new) + np.arange(query_start[-1])
            input_ids = [t for r, s, n in zip(rows.tolist(), start.tolist(), num_new.tolist())
                         for t in batch.tokens[r][s:s + n]]
        slot_mapping = batch.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        max_blocks = -(-int(seq_lens.max()) // bs)
        token_slots = batch.adapter_slot[token_rows]
        samples = np.asarray(plan.samples, dtype=bool)
        device = self.device
        attention = AttentionMetadata(
            slot_mapping=_to(slot_mapping, device),
            block_tables=_to(np.ascontiguousarray(batch.block_table[rows, :max_blocks]), device),
            query_start_loc=_to(query_start.astype(np.int32), device),
            seq_lens=_to(seq_lens.astype(np.int32), device),
            max_query_len=max_query_len,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=_to(positions, device),
            attention=attention,
            token_slots=_to(token_slots, device) if token_slots.any() else None,
            logits_indices=_to(query_start[1:][samples] - 1, device),
            sample_rows=rows[samples],
        )

    def _sample(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """One token per row of logits [num_samples, vocab]."""
        batch = self.batch
        temperature = batch.temperature[rows]
        if not temperature.any():
            return logits.argmax(dim=-1)
        offsets = np.fromiter((len(batch.tokens[r]) for r in rows.tolist()), np.int64, len(rows))
        offsets -= batch.num_prompt_tokens[rows]
        device = logits.device
        return self.ops.sample(
            logits, _to(temperature, device), _to(batch.top_k[rows], device),
            _to(batch.top_p[rows], device), _to(batch.seed[rows], device), _to(offsets, device),
        )

    def _result(
        self, plan: StepPlan, logits: torch.Tensor, rows: np.ndarray, tokens: torch.Tensor
    ) -> StepResult:
        sampled_ids = [r for r, s in zip(plan.request_ids, plan.samples) if s]
        token_list = tokens.tolist()
        result = StepResult(sampled_ids, token_list)
        wanted = self.batch.logprobs[rows]
        if (wanted >= 0).any():
            logprobs = torch.log_softmax(logits, dim=-1)
            for i in np.flatnonzero(wanted >= 0).tolist():
                top = logprobs[i].topk(int(wanted[i])) if wanted[i] > 0 else None
                result.logprobs[sampled_ids[i]] = TokenLogprob(
                    token_id=token_list[i],
                    logprob=float(logprobs[i, token_list[i]]),
                    top={} if top is None else dict(zip(top.indices.tolist(), top.values.tolist())),
                )
        return result

    def _advance(self, plan: StepPlan, sample_rows: np.ndarray, tokens: list[int]) -> None:
        batch = self.batch
        rows = np.fromiter((batch.row_of[r] for r in plan.request_ids), np.int64, len(plan.request_ids))
        batch.num_computed[rows] += np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        for row, token in zip(sample_rows.tolist(), tokens):
            batch.tokens[row].append(token)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
