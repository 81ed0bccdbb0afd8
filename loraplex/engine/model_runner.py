"""Turns a step plan into tensors, runs the model and samples. Owns the KV cache, the LoRA
slot buffers and its own per-request arrays (InputBatch); never touches scheduler state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.cuda_graphs import DecodeGraphRunner, DecodeInputs
from loraplex.engine.input_batch import InputBatch
from loraplex.engine.lora_weights import HostAdapter, LoraSlotBuffers
from loraplex.engine.plan import StepPlan, StepResult
from loraplex.kernels import Ops
from loraplex.model.context import AttentionMetadata, ForwardContext, LoraMetadata, forward_context
from loraplex.model.llama import LlamaForCausalLM
from loraplex.types import TokenLogprob


@dataclass
class HostInputs:
    """A step's inputs on the host (numpy), before they go to the device."""

    rows: np.ndarray  # [num_seqs]: InputBatch rows of the scheduled requests
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    query_start: np.ndarray  # [num_seqs + 1] int64
    seq_lens: np.ndarray  # [num_seqs] int64
    token_slots: np.ndarray  # [num_tokens] int32
    samples: np.ndarray  # [num_seqs] bool
    max_query_len: int


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: torch.Tensor, lora: LoraSlotBuffers, ops: Ops,
        max_num_seqs: int, max_blocks_per_seq: int, host_adapter: Callable[[str], HostAdapter],
        use_cuda_graphs: bool = False,
    ) -> None:
        self.model, self.kv_cache, self.lora, self.ops = model, kv_cache, lora, ops
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]
        self.batch = InputBatch(max_num_seqs, max_blocks_per_seq)
        self._host_adapter = host_adapter
        self.graphs: DecodeGraphRunner | None = None
        if use_cuda_graphs:
            self.graphs = DecodeGraphRunner(model, kv_cache, lora, ops, max_num_seqs, max_blocks_per_seq,
                                            capture=self.device.type == "cuda")

    def execute(self, plan: StepPlan) -> StepResult:
        """One step: apply the plan, prepare its inputs, run the model, return the tokens.
        (The phases are public so that benchmarks can time them apart.)"""
        self.apply(plan)
        if plan.is_empty:
            return StepResult()
        host = self.prepare(plan)
        logits, tokens = self.run(host)
        return self.finish(plan, host, logits, tokens)

    def run(self, host: HostInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [num_samples, vocab], tokens [num_samples]) of the rows that sample: a decode
        step replays a CUDA graph, anything else runs eagerly."""
        if self.graphs is None or host.max_query_len != 1 or not self.graphs.can_run(len(host.rows)):
            return self._run_eager(host)
        logits, tokens = self.graphs.run(self._decode_inputs(host))
        if not host.samples.all():  # a prompt chunk of one token that does not sample yet
            keep = _to(np.flatnonzero(host.samples), self.device)
            logits, tokens = logits[keep], tokens[keep]
        return logits, tokens

    def finish(self, plan: StepPlan, host: HostInputs, logits: torch.Tensor, tokens: torch.Tensor
               ) -> StepResult:
        """The step's result (waits for the device), and the runner's records advanced."""
        sample_rows = host.rows[host.samples]
        with torch.inference_mode():
            result = self._result(plan, logits, sample_rows, tokens)
        self._advance(plan, host.rows, sample_rows, result.sampled_tokens)
        return result

    def apply(self, plan: StepPlan) -> None:
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

    def prepare(self, plan: StepPlan) -> HostInputs:
        """Flat inputs and attention/LoRA metadata of the scheduled requests, on the host."""
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
        return HostInputs(
            rows=rows, input_ids=np.asarray(input_ids, dtype=np.int64), positions=positions,
            slot_mapping=slot_mapping, block_tables=batch.block_table[rows, :max_blocks],
            query_start=query_start, seq_lens=seq_lens, token_slots=batch.adapter_slot[token_rows],
            samples=np.asarray(plan.samples, dtype=bool), max_query_len=max_query_len,
        )

    def _run_eager(self, host: HostInputs) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.device
        attention = AttentionMetadata(
            slot_mapping=_to(host.slot_mapping, device),
            block_tables=_to(np.ascontiguousarray(host.block_tables), device),
            query_start_loc=_to(host.query_start.astype(np.int32), device),
            seq_lens=_to(host.seq_lens.astype(np.int32), device),
            max_query_len=host.max_query_len,
        )
        lora = LoraMetadata(_to(host.token_slots, device), self.lora) if host.token_slots.any() else None
        logits_indices = _to(host.query_start[1:][host.samples] - 1, device)
        with torch.inference_mode(), forward_context(ForwardContext(self.kv_cache, attention, lora)):
            hidden = self.model(_to(host.input_ids, device), _to(host.positions, device))
            logits = self.model.compute_logits(hidden[logits_indices])
            tokens = self._sample(logits, host.rows[host.samples])
        return logits, tokens

    def _decode_inputs(self, host: HostInputs) -> DecodeInputs:
        batch, rows = self.batch, host.rows
        return DecodeInputs(
            input_ids=host.input_ids, positions=host.positions, slot_mapping=host.slot_mapping,
            block_tables=host.block_tables, seq_lens=host.seq_lens.astype(np.int32),
            token_slots=host.token_slots, temperature=batch.temperature[rows], top_k=batch.top_k[rows],
            top_p=batch.top_p[rows], seeds=batch.seed[rows], offsets=self._offsets(rows),
        )

    def _offsets(self, rows: np.ndarray) -> np.ndarray:
        """Index of the output token each row samples next (the sampling noise's offset)."""
        batch = self.batch
        lengths = np.fromiter((len(batch.tokens[r]) for r in rows.tolist()), np.int64, len(rows))
        return lengths - batch.num_prompt_tokens[rows]

    def _sample(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """One token per row of logits [num_samples, vocab]."""
        batch = self.batch
        temperature = batch.temperature[rows]
        if not temperature.any():
            return self.ops.argmax(logits)
        offsets = self._offsets(rows)
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

    def _advance(self, plan: StepPlan, rows: np.ndarray, sample_rows: np.ndarray, tokens: list[int]) -> None:
        batch = self.batch
        batch.num_computed[rows] += np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        for row, token in zip(sample_rows.tolist(), tokens):
            batch.tokens[row].append(token)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
