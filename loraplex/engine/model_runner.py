"""Turns a step plan into a forward pass and sampled tokens. Owns the KV cache, the LoRA slot
buffers, its own per-request records (InputBatch) and the step inputs (StepInputs); never
touches scheduler state.

A step is launched (`launch`: records updated, inputs filled and copied, the model and the
sampler queued on the device) and later collected (`collect`: waits for its tokens). Between
the two the host may plan and launch the next step: a request whose input token is still on the
device gets it there, from `row_tokens`, the last token sampled for each InputBatch row, so no
step waits on the host. `forward` is the one forward pass: eager steps run it on the step's
exact sizes, and the decode graphs capture it at padded batch sizes.

Structured outputs: a step's constrained samples are drawn again under their token masks
(`sample(masked=True)`, a small graph of its own at each padded decode size) after the
forward pass has drawn every sample without them (sampling depends only on each row's logits,
seed and offset, so the unconstrained rows draw the same tokens again). So the forward pass
can be queued (`begin`) before the host knows the masks: the engine collects the previous
step's tokens, advances the grammars and fills the masks while the device computes, then
`finish` queues the masked draw."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.engine import prompt_logprobs
from loraplex.engine.cuda_graphs import MIXED_TOKEN_BUCKETS, DecodeGraphs
from loraplex.engine.input_batch import InputBatch
from loraplex.engine.kv_swap import KvSwapper
from loraplex.engine.lora_weights import LoraSlotBuffers
from loraplex.engine.plan import StepPlan, StepResult, TokenMasks
from loraplex.engine.relay_groups import RelayRule
from loraplex.engine.step_inputs import (
    FLORA_ROW_BUCKETS,
    PENDING,
    FilledStep,
    SlotFamilies,
    StepInputs,
    StepShape,
)
from loraplex.engine.streaming import rotate_keys
from loraplex.kernels import Ops
from loraplex.model.context import (
    AttentionMetadata,
    ForwardContext,
    LoraMetadata,
    RelayMetadata,
    forward_context,
)
from loraplex.model.llama import LlamaForCausalLM
from loraplex.types import TokenLogprob


@dataclass
class QueuedLogprobs:
    """Logprobs of the sampled rows that asked for them, on their way to the host."""

    which: list[int]  # indices into the step's sampled rows
    ks: list[int]  # how many top logprobs each wants
    chosen: torch.Tensor  # [num_wanted] float32: the sampled token's logprob
    top_values: torch.Tensor  # [num_wanted, max k] float32
    top_indices: torch.Tensor  # [num_wanted, max k] int64


@dataclass
class StartedStep:
    """A step whose forward pass (and unmasked sampling) is queued, until `finish` samples the
    constrained rows under their masks and queues the results to the host."""

    plan: StepPlan
    filled: FilledStep
    logits: torch.Tensor  # [num_samples, vocab] float32: the model's own
    tokens: torch.Tensor  # [num_samples] int64: drawn without masks
    prompt: prompt_logprobs.QueuedPromptLogprobs | None = None
    started: torch.cuda.Event | float | None = None
    """With `time_steps`: where the step began (an event on the stream; perf_counter on CPU)."""


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
    started: torch.cuda.Event | None = None
    """With `time_steps` on CUDA: the event recorded where the step began."""
    device_s: float | None = None
    """With `time_steps` on CPU: the launch's time (the CPU runs it as it is launched)."""


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: torch.Tensor, lora: LoraSlotBuffers, ops: Ops,
        max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        use_cuda_graphs: bool = False, num_host_blocks: int = 0, flora_graphs: bool = False,
        relay: RelayRule | None = None, mixed_graphs: bool = False,
    ) -> None:
        """`num_host_blocks`: the host pool that preempted requests' KV is swapped to;
        `flora_graphs`: capture the decode graphs of steps with FLoRA rows too; `relay`: when
        decode steps read shared prefixes once per relay group (None: never); `mixed_graphs`:
        capture steps that compute prompt tokens too (EngineConfig.mixed_step_graphs)."""
        self.model, self.kv_cache, self.lora, self.ops = model, kv_cache, lora, ops
        self.swapper = KvSwapper(kv_cache, num_host_blocks) if num_host_blocks else None
        self.device = kv_cache.device
        self.inputs = StepInputs(max(max_num_batched_tokens, max_num_seqs), max_num_seqs,
                                 max_model_len, kv_cache.shape[3], self.device,
                                 SlotFamilies(lora.slot_flora_rank, lora.slot_input_scaled,
                                              lora.slot_needs_expand), relay,
                                 vocab_size=model.config.vocab_size)
        self.batch = InputBatch(max_num_seqs, self.inputs.max_blocks_per_seq)
        # [max_num_seqs + 1]: the last token sampled for each row; the spare row takes padding's.
        self.row_tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self.on_logits: Callable[[list[str], torch.Tensor], None] | None = None
        """Called at launch with the sampled request ids and their logits [num_samples, vocab]
        (a benchmark's hook; it may synchronise)."""
        self.time_steps = False
        """Time each step on the device (StepResult.device_s): two CUDA events a step."""
        self.graphs: DecodeGraphs | None = None
        if use_cuda_graphs:
            self.graphs = DecodeGraphs(self, max_num_seqs, model.config.vocab_size,
                                       capture=self.device.type == "cuda", flora=flora_graphs,
                                       mixed=mixed_graphs)

    # A step -------------------------------------------------------------------------------
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Apply the plan, fill its inputs and queue the model and the sampler (under the plan's
        token masks); returns at once on CUDA. (The phases are public so that benchmarks can
        time them apart.)"""
        return self.finish(self.begin(plan), plan.token_masks)

    def begin(self, plan: StepPlan) -> StartedStep | None:
        """Apply the plan, fill its inputs and queue the forward pass, which draws every sample
        without masks; None if the plan computes nothing. `finish` completes the step."""
        started = self._start_timer() if self.time_steps else None
        self.apply(plan)
        if self.swapper is not None:
            self.swapper.before_step(plan.swap_out, plan.swap_in)
        if plan.is_empty:
            return None
        filled = self.prepare(plan)
        return StartedStep(plan, filled, *self.run(filled.shape, filled.prompt), started=started)

    def _start_timer(self) -> torch.cuda.Event | float:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self, started: StartedStep | None, masks: TokenMasks | None) -> LaunchedStep:
        """Draw the samples that `masks` constrains again under their masks (the others keep
        their tokens), then queue the step's results to the host."""
        if started is None:
            return LaunchedStep()
        tokens = started.tokens
        if masks is not None and masks.request_ids:
            tokens = self.sample_masked(started, masks)
        launched = self.dispatch(started.plan, started.filled, started.logits, tokens, started.prompt)
        if isinstance(started.started, float):
            launched.device_s = time.perf_counter() - started.started
        elif started.started is not None:
            launched.started = started.started
        return launched

    def apply(self, plan: StepPlan) -> None:
        """Bring the runner's records up to date with the plan. Window blocks dropped (attention
        sinks) go first: a request may be preempted (swapped out) in the plan that drops them."""
        batch = self.batch
        if plan.dropped_blocks:
            self._drop_blocks(plan.dropped_blocks)
        for request_id in plan.forgotten_ids:
            batch.remove(request_id)
        for seq in plan.new:
            batch.add(seq)
        for request_id, block_ids in plan.new_block_ids.items():
            batch.append_blocks(batch.row_of[request_id], block_ids)

    def _drop_blocks(self, dropped: dict[str, tuple[int, int]]) -> None:
        """Drop window blocks from the requests' tables and rotate the keys of the blocks that
        move up back by the tokens dropped (loraplex/engine/streaming.py)."""
        if self.swapper is not None:  # keys swapped in by the previous step are rotated too
            self.swapper.wait_for_swap_ins()
        block_size = self.kv_cache.shape[3]
        for request_id, (first, count) in dropped.items():
            moved = self.batch.drop_blocks(self.batch.row_of[request_id], first, count, block_size)
            if len(moved):
                blocks = torch.from_numpy(moved.astype(np.int64)).to(self.device)
                rotate_keys(self.kv_cache, blocks, self.model.cos_sin[count * block_size])

    def prepare(self, plan: StepPlan) -> FilledStep:
        """Fill the step inputs from the plan (padded for a graph where one will run) and queue
        their copy to the device."""
        pad_to = pad_mixed = None
        if self.graphs is not None and max(plan.num_scheduled_tokens) == 1:
            pad_to = self.graphs.padded_size(len(plan.request_ids))
        elif self.graphs is not None:
            pad_mixed = self.graphs.mixed_padding(sum(plan.num_scheduled_tokens), len(plan.request_ids))
        filled = self.inputs.fill(plan, self.batch, pad_to, pad_mixed)
        shape = filled.shape
        if shape.is_padded_mixed and (shape.has_flora or self.graphs.capture and not self.graphs.has(shape)):
            filled = self.inputs.fill(plan, self.batch, None)  # no graph for it: eagerly, unpadded
        if self.batch.num_scoring_rows:
            batch, rows = self.batch, filled.rows
            prompt = prompt_logprobs.select(rows, filled.start, filled.num_new, filled.query_start,
                                            batch.num_prompt_tokens[rows], batch.prompt_logprobs[rows],
                                            batch.tokens)
            if prompt is not None and filled.shape.is_padded:  # scoring steps run eagerly
                filled = self.inputs.fill(plan, self.batch, None)
            filled.prompt = prompt
        self.inputs.upload()
        return filled

    def sample_masked(self, started: StartedStep, masks: TokenMasks) -> torch.Tensor:
        """[num_samples] int64: the started step's samples drawn again, those of `masks` under
        their bitmask rows (a graph replay for a padded decode step that has one)."""
        plan, shape = started.plan, started.filled.shape
        if shape.is_padded_decode:  # every row samples, in plan order
            position = {request_id: i for i, request_id in enumerate(plan.request_ids)}
        else:
            sampled = (r for r, s in zip(plan.request_ids, plan.samples) if s)
            position = {request_id: i for i, request_id in enumerate(sampled)}
        self.inputs.fill_masks(shape.num_samples, [position[r] for r in masks.request_ids], masks.bitmask)
        if shape.is_padded_decode and self.graphs is not None and self.graphs.has_masked(shape):
            return self.graphs.replay_masked(shape)
        with torch.inference_mode():
            return self.sample(shape, started.logits, masked=True)

    def run(self, shape: StepShape, prompt: prompt_logprobs.PromptSelection | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, prompt_logprobs.QueuedPromptLogprobs | None]:
        """(logits [num_samples, vocab] float32, tokens [num_samples], the prompt logprobs
        queued to the host if the step scores any) of a filled step: a graph replay for a padded
        step that has one, else the forward pass run eagerly."""
        if shape.is_padded and self.graphs is not None and self.graphs.has(shape):
            return *self.graphs.replay(shape), None
        with torch.inference_mode():
            return self.forward(shape, prompt)

    def forward(self, shape: StepShape, prompt: prompt_logprobs.PromptSelection | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, prompt_logprobs.QueuedPromptLogprobs | None]:
        """The forward pass and the sampler (no masks) over the device step inputs, sliced to
        `shape`, and the log-probabilities of the prompt positions in `prompt` from the same
        pass."""
        s, t, n = self.inputs, shape.num_tokens, shape.num_samples
        attention = AttentionMetadata(
            slot_mapping=s.slot_mapping[:t], block_tables=s.block_tables[:shape.num_seqs],
            query_start_loc=s.query_start_loc[:shape.num_seqs + 1], seq_lens=s.seq_lens[:shape.num_seqs],
            max_query_len=shape.max_query_len)
        if shape.has_relay:
            attention.relay = RelayMetadata(s.prefix_lens[:shape.num_seqs], s.relay_members[:shape.num_seqs],
                                            s.group_starts[:shape.num_group_starts])
        lora = None
        if shape.has_lora:
            slots = s.token_slots[:t]
            lora = LoraMetadata(slots, self.lora, has_input_scale=shape.has_input_scale,
                                has_expand=shape.has_expand, flora=s.flora if shape.has_flora else None,
                                split=self.ops.lone_split(slots) if shape.has_expand else None)
        with forward_context(ForwardContext(self.kv_cache, attention, lora)):
            input_ids = s.input_ids[:t]
            input_ids = torch.where(input_ids == PENDING, self.row_tokens[s.token_rows[:t]], input_ids)
            hidden = self.model(input_ids, s.positions[:t])
            scored = None if prompt is None else prompt_logprobs.compute(
                self.model, hidden, prompt, lambda array: _to_device(array, self.device), _to_host)
            if not shape.is_padded_decode:  # every row samples in a padded decode step
                hidden = hidden[s.logits_indices[:n]]
            logits = self.model.compute_logits(hidden)
            tokens = self.sample(shape, logits)
        return logits, tokens, scored

    def sample(self, shape: StepShape, logits: torch.Tensor, masked: bool = False) -> torch.Tensor:
        """[num_samples] int64 tokens drawn from `logits` [num_samples, vocab] by the step
        inputs' sampling parameters, and stored in `row_tokens`. `masked`: under the token masks
        of `fill_masks` (on a copy: `logits` stay the model's own, for logprobs)."""
        s, n = self.inputs, shape.num_samples
        drawn = self.ops.mask_logits(logits, s.mask_rows[:n], s.bitmask[:n]) if masked else logits
        if shape.is_greedy:
            tokens = self.ops.argmax(drawn)
        else:
            tokens = self.ops.sample(drawn, s.temperature[:n], s.top_k[:n], s.top_p[:n],
                                     s.seeds[:n], s.offsets[:n])
        self.row_tokens[s.sample_rows[:n]] = tokens
        return tokens

    def dispatch(self, plan: StepPlan, filled: FilledStep, logits: torch.Tensor, tokens: torch.Tensor,
                 prompt: prompt_logprobs.QueuedPromptLogprobs | None = None) -> LaunchedStep:
        """Queue the copies of a run's results to the host and advance the runner's records."""
        if filled.shape.is_padded_decode:  # every row sampled, padding and all: keep the real ones
            if filled.samples.all():
                logits, tokens = logits[:filled.num_real_seqs], tokens[:filled.num_real_seqs]
            else:  # a prompt chunk of one token that does not sample yet ran as a decode row
                keep = torch.from_numpy(np.flatnonzero(filled.samples)).to(logits.device)
                logits, tokens = logits[keep], tokens[keep]
        elif filled.shape.is_padded_mixed:  # the real samples first, then padding rows
            num_samples = int(filled.samples.sum())
            logits, tokens = logits[:num_samples], tokens[:num_samples]
        sample_rows = filled.rows[filled.samples]
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
            step.done = torch.cuda.Event(enable_timing=self.time_steps)
            step.done.record()
        batch = self.batch
        batch.num_computed[filled.rows] += np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
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
        result = StepResult(step.sampled_ids, tokens, device_s=step.device_s)
        if step.started is not None and step.done is not None:
            result.device_s = step.started.elapsed_time(step.done) / 1e3
        if step.logprobs is not None:
            self._collect_logprobs(step, result)
        if step.prompt_logprobs is not None:
            result.prompt_logprobs = prompt_logprobs.collect(step.prompt_logprobs, step.request_ids)
        return result

    # Start-up ------------------------------------------------------------------------------
    def warm_up(self, max_num_batched_tokens: int) -> int:
        """Run dummy prefill steps (they store nothing) so that the first requests find every
        kernel variant compiled. Kernels pick variants by the step's size: Triton specializes
        integer arguments on whether they divide by 16, and the LoRA shrink splits its input
        dim by how many token tiles there are. So: steps of 16, 32, ... up to
        `max_num_batched_tokens` tokens and one token fewer, with adapters, in one sequence,
        many and uneven ones (as many sequences as it takes where one would be longer than a
        sequence can be); and without adapters, greedy and sampling. Returns the steps run."""
        sizes = [1 << i for i in range(4, max_num_batched_tokens.bit_length())
                 if 1 << i < max_num_batched_tokens] + [max_num_batched_tokens]
        shapes = [(num_seqs, size // num_seqs) for size, num_seqs in zip(sizes, itertools.cycle((1, 16, 3)))]
        shapes += [(1, size - 1) for size in sizes if size > 16]
        shapes = [self.inputs.dummy_shape(n, t) for n, t in shapes if n <= self.inputs.max_seqs]
        shapes = [(n, t) for n, t in dict.fromkeys(shapes) if t >= 2]
        variants = [(shape, True, False) for shape in shapes]
        variants += [(shape, has_lora, is_greedy)
                     for shape in map(self.inputs.dummy_shape, (3, 1), (17, max_num_batched_tokens))
                     for has_lora in (False, True) for is_greedy in (False, True)]
        with torch.inference_mode():
            for (num_seqs, tokens_per_seq), has_lora, is_greedy in variants:
                shape = self.inputs.fill_dummy(num_seqs, tokens_per_seq, adapter_slot=int(has_lora),
                                               is_greedy=is_greedy, has_lora=has_lora)
                self.inputs.upload()
                self.forward(shape)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # or the first requests would queue behind it
        return len(variants)

    # Memory --------------------------------------------------------------------------------
    def measure_peak_bytes(self, num_seqs: int, tokens_per_seq: int, flora_rows: int = 0) -> int:
        """Device memory a step of that shape takes beyond what is allocated now (a dummy step,
        with LoRA and sampling, and `flora_rows` padding FLoRA rows, that stores nothing)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        num_seqs, tokens_per_seq = self.inputs.dummy_shape(num_seqs, tokens_per_seq)
        shape = self.inputs.fill_dummy(num_seqs, tokens_per_seq, adapter_slot=1, is_greedy=False,
                                       has_lora=True, flora_rows=flora_rows)
        self.inputs.upload()
        with torch.inference_mode():
            self.forward(shape)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    # Logprobs ------------------------------------------------------------------------------
    def _queue_logprobs(self, step: LaunchedStep, logits: torch.Tensor, tokens: torch.Tensor,
                        rows: np.ndarray) -> None:
        """For the sampled rows that asked for logprobs: the chosen token's logprob and the top
        k, computed on the device and queued to the host."""
        wanted = self.batch.logprobs[rows]
        which = np.flatnonzero(wanted >= 0)
        if not len(which):
            return
        index = torch.from_numpy(which).to(logits.device)
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


def measure_step_bytes(
    model: LlamaForCausalLM, ops: Ops, kv_block_shape: tuple[int, ...], max_lora_rank: int,
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, use_graphs: bool,
    mixed_graphs: bool = False,
) -> tuple[int, int]:
    """(activation bytes, decode graph bytes) of `model` on CUDA, measured by dummy steps on
    scratch buffers (one KV block of `kv_block_shape`, one adapter slot): the largest eager
    step's peak, with the logits of a slice of scored prompt positions on top, and with
    `use_graphs` the largest decode graph's with its static outputs."""
    device, dtype = model.norm.device, model.norm.dtype
    scratch = ModelRunner(model, torch.zeros((1, *kv_block_shape), dtype=dtype, device=device),
                          LoraSlotBuffers(model.config, 1, max_lora_rank, dtype, device), ops,
                          max_num_seqs, max_num_batched_tokens, max_model_len)
    activations = scratch.measure_peak_bytes(1, max_num_batched_tokens) + prompt_logprobs.SLICE_BYTES
    scratch.measure_peak_bytes(3, 17)  # compiles the kernels for uneven prompts too
    graphs = 0
    if use_graphs:
        graphs = max(scratch.measure_peak_bytes(max_num_seqs, 1),
                     scratch.measure_peak_bytes(max_num_seqs, 1, flora_rows=FLORA_ROW_BUCKETS[-1]))
        mixed = [t for t in MIXED_TOKEN_BUCKETS if t <= max(max_num_batched_tokens, max_num_seqs)]
        if mixed_graphs and mixed:  # the largest mixed-step graph's, its sample rows all sequences
            seqs = min(max_num_seqs, mixed[-1] // 2)
            graphs = max(graphs, scratch.measure_peak_bytes(seqs, mixed[-1] // seqs))
        graphs += max_num_seqs * model.config.vocab_size * 4
    return activations, graphs


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued behind the step on CUDA (read it after the step's event)."""
    if tensor.device.type == "cpu":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
