"""Turns a step plan into tensors, runs the model and samples. Owns the KV cache, the LoRA
slot buffers and its own per-request arrays (InputBatch); never touches scheduler state.

A step is launched (`launch`: inputs prepared, model and sampler queued on the device) and
later collected (`collect`: waits for its tokens). Between the two the host may plan and
launch the next step: a request whose input token is still on the device gets it there, from
`row_tokens`, the last token sampled for each InputBatch row, so no step waits on the host."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.engine import prompt_logprobs
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
    token_rows: np.ndarray  # [num_tokens]: the row of each token
    input_ids: np.ndarray  # [num_tokens] int64; PENDING where the token is still on the device
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    query_start: np.ndarray  # [num_seqs + 1] int64
    seq_lens: np.ndarray  # [num_seqs] int64
    token_slots: np.ndarray  # [num_tokens] int32
    samples: np.ndarray  # [num_seqs] bool
    max_query_len: int
    prompt: prompt_logprobs.PromptSelection | None = None
    """Positions whose prompt logprobs the step computes (such a step runs eagerly)."""


PENDING = -1
"""A token id the host does not know yet (sampled by a step still in flight)."""


@dataclass
class QueuedLogprobs:
    """Logprobs of the sampled rows that asked for them, on their way to the host."""

    which: list[int]  # indices into the step's sampled rows
    ks: list[int]  # how many top logprobs each wants
    chosen: torch.Tensor  # [num_wanted] float32: the sampled token's logprob
    top_values: torch.Tensor  # [num_wanted, max k] float32
    top_indices: torch.Tensor  # [num_wanted, max k] int64


@dataclass
class LaunchedStep:
    """A step queued on the device, until `collect` reads its tokens."""

    sampled_ids: list[str] = field(default_factory=list)
    tokens: torch.Tensor | None = None  # [num_samples] int64 (pinned host memory on CUDA)
    done: torch.cuda.Event | None = None
    placeholders: list[tuple[list[int], int]] = field(default_factory=list)
    """(the row's token list, index) where each sampled token goes in the InputBatch."""
    logprobs: QueuedLogprobs | None = None
    prompt_logprobs: prompt_logprobs.QueuedPromptLogprobs | None = None
    request_ids: list[str] = field(default_factory=list)
    """The step's scheduled requests, in plan order (kept when it scores prompt tokens)."""


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
        # [max_num_seqs + 1]: the last token sampled for each row; the extra row takes padding.
        self.row_tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self.on_logits: Callable[[list[str], torch.Tensor], None] | None = None
        """Called at launch with the sampled request ids and their logits [num_samples, vocab]
        (a benchmark's hook; it may synchronise)."""
        self.graphs: DecodeGraphRunner | None = None
        if use_cuda_graphs:
            self.graphs = DecodeGraphRunner(model, kv_cache, lora, ops, self.row_tokens, max_num_seqs,
                                            max_blocks_per_seq, capture=self.device.type == "cuda")

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Apply the plan, prepare its inputs and queue the model and the sampler; returns at
        once on CUDA. (The phases are public so that benchmarks can time them apart.)"""
        self.apply(plan)
        if plan.is_empty:
            return LaunchedStep()
        host = self.prepare(plan)
        return self.dispatch(plan, host, *self.run(host))

    def dispatch(self, plan: StepPlan, host: HostInputs, logits: torch.Tensor, tokens: torch.Tensor,
                 prompt: prompt_logprobs.QueuedPromptLogprobs | None = None) -> LaunchedStep:
        """Queue the copies of a run's results to the host and advance the runner's records."""
        sample_rows = host.rows[host.samples]
        sampled_ids = [r for r, s in zip(plan.request_ids, plan.samples) if s]
        if self.on_logits is not None:
            self.on_logits(sampled_ids, logits)
        step = LaunchedStep(sampled_ids=sampled_ids, prompt_logprobs=prompt)
        if prompt is not None:
            step.request_ids = list(plan.request_ids)
        with torch.inference_mode():
            self._queue_logprobs(step, logits, tokens, sample_rows)
            step.tokens = _to_host(tokens)
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()
        batch = self.batch
        batch.num_computed[host.rows] += np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        for row in sample_rows.tolist():
            tokens_of_row = batch.tokens[row]
            step.placeholders.append((tokens_of_row, len(tokens_of_row)))
            tokens_of_row.append(PENDING)
        return step

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens; its records in the InputBatch are filled in."""
        if step.tokens is None:
            return StepResult()
        if step.done is not None:
            step.done.synchronize()
        tokens = step.tokens.tolist()
        for (tokens_of_row, index), token in zip(step.placeholders, tokens):
            tokens_of_row[index] = token  # a row dropped since holds a list no one reads
        result = StepResult(step.sampled_ids, tokens)
        if step.logprobs is not None:
            self._collect_logprobs(step, result)
        if step.prompt_logprobs is not None:
            result.prompt_logprobs = prompt_logprobs.collect(step.prompt_logprobs, step.request_ids)
        return result

    def run(self, host: HostInputs
            ) -> tuple[torch.Tensor, torch.Tensor, prompt_logprobs.QueuedPromptLogprobs | None]:
        """(logits [num_samples, vocab], tokens [num_samples]) of the rows that sample, and the
        prompt logprobs queued to the host if the step scores any: a decode step replays a CUDA
        graph, anything else runs eagerly."""
        if (self.graphs is None or host.max_query_len != 1 or host.prompt is not None
                or not self.graphs.can_run(len(host.rows))):
            return self._run_eager(host)
        logits, tokens = self.graphs.run(self._decode_inputs(host))
        if not host.samples.all():  # a prompt chunk of one token that does not sample yet
            keep = _to(np.flatnonzero(host.samples), self.device)
            logits, tokens = logits[keep], tokens[keep]
        return logits, tokens, None

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
        prompt = None if not batch.num_scoring_rows else prompt_logprobs.select(
            rows, start, num_new, query_start, batch.num_prompt_tokens[rows], batch.prompt_logprobs[rows],
            batch.tokens)
        return HostInputs(
            rows=rows, token_rows=token_rows, input_ids=np.asarray(input_ids, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping, block_tables=batch.block_table[rows, :max_blocks],
            query_start=query_start, seq_lens=seq_lens, token_slots=batch.adapter_slot[token_rows],
            samples=np.asarray(plan.samples, dtype=bool), max_query_len=max_query_len, prompt=prompt,
        )

    def _run_eager(self, host: HostInputs
                   ) -> tuple[torch.Tensor, torch.Tensor, prompt_logprobs.QueuedPromptLogprobs | None]:
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
            input_ids = _to(host.input_ids, device)
            if (host.input_ids == PENDING).any():
                from_device = self.row_tokens[_to(host.token_rows, device)]
                input_ids = torch.where(input_ids == PENDING, from_device, input_ids)
            hidden = self.model(input_ids, _to(host.positions, device))
            prompt = None if host.prompt is None else prompt_logprobs.compute(
                self.model, hidden, host.prompt, lambda array: _to(array, device), _to_host)
            logits = self.model.compute_logits(hidden[logits_indices])
            sample_rows = host.rows[host.samples]
            tokens = self._sample(logits, sample_rows)
            self.row_tokens[_to(sample_rows, device)] = tokens
        return logits, tokens, prompt

    def _decode_inputs(self, host: HostInputs) -> DecodeInputs:
        batch, rows = self.batch, host.rows
        return DecodeInputs(
            rows=rows, input_ids=host.input_ids, positions=host.positions, slot_mapping=host.slot_mapping,
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

    def _queue_logprobs(self, step: LaunchedStep, logits: torch.Tensor, tokens: torch.Tensor,
                        rows: np.ndarray) -> None:
        """For the sampled rows that asked for logprobs: the chosen token's logprob and the top
        k, computed on the device and queued to the host."""
        wanted = self.batch.logprobs[rows]
        which = np.flatnonzero(wanted >= 0)
        if not len(which):
            return
        index = _to(which, logits.device)
        logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # [num_wanted, vocab]
        chosen = logprobs.gather(1, tokens[index].view(-1, 1)).view(-1)
        top_values, top_indices = logprobs.topk(max(1, int(wanted[which].max())), dim=-1)
        step.logprobs = QueuedLogprobs(
            which=which.tolist(), ks=wanted[which].tolist(), chosen=_to_host(chosen),
            top_values=_to_host(top_values), top_indices=_to_host(top_indices))

    @staticmethod
    def _collect_logprobs(step: LaunchedStep, result: StepResult) -> None:
        lp = step.logprobs
        chosen, values, indices = lp.chosen.tolist(), lp.top_values.tolist(), lp.top_indices.tolist()
        for j, (i, k) in enumerate(zip(lp.which, lp.ks)):
            result.logprobs[step.sampled_ids[i]] = TokenLogprob(
                token_id=result.sampled_tokens[i], logprob=chosen[j],
                top=dict(zip(indices[j][:k], values[j][:k])),
            )


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued behind the step on CUDA (read it after the step's event)."""
    if tensor.device.type == "cpu":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
