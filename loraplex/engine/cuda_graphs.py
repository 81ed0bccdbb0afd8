"""Decode steps captured as CUDA graphs at padded batch sizes, when the engine is built.

A Triton launch costs about 19 us of host time and a decode step has hundreds of them; replayed
from a graph, a small kernel costs about 1 us. A graph captures the runner's own forward pass
over the step inputs (StepInputs), sliced to its padded size: a step fills those buffers and
replays the graph of its size. One graph per (padded batch size, whether any token has an
adapter, whether every row is greedy, whether an adapter scales o's input, whether one needs the
LoRA shrink and expand, the FLoRA rows, and with relay attention on, whether the step has relay
groups): a batch without adapters launches no adapter kernels;
one of IA3 (on q/k/v, gate/up, down's input: the rotary and activation kernels apply those) and
FLoRA adapters no shrink or expand; one without IA3 on o's input no row scaling; an all-greedy
batch takes an argmax instead of the sampling kernel. A step's FLoRA rows are padded to the next
of FLORA_ROW_BUCKETS (16, 64, 256, 1024; more run eagerly), each bucket captured up to the
rows the batch size can have, and only when the engine asks for FLoRA graphs
(LoRAConfig.flora_graphs): 8 graphs a batch size without them, up to 24 with them (64 slots of
max rank 16: 88 against 228); with relay attention on, each also with relay groups (their
members and prefixes live in fixed-size step inputs, so one graph replays any grouping). Every
graph is captured up front (`capture_all`), largest first so that the smaller ones reuse its
memory pool; a request never waits on a capture.

With `mixed` (EngineConfig.mixed_step_graphs), steps that compute prompt tokens beside decodes
are captured too, at padded (tokens, sequences): tokens in MIXED_TOKEN_BUCKETS (up to the step
budget), sequences in MIXED_SEQ_BUCKETS (up to max_batch, and max_batch itself), without
adapters or with the LoRA shrink and expand, greedy or not; such a step otherwise runs eagerly,
bound by the host's launches (on the H100 32 decodes and a 256-token prompt with 64 adapters:
42.6 ms, its kernels 15). The prefill attention kernel's grid depends on the token and sequence
counts alone, so one graph serves any split of its tokens between sequences. Steps with
FLoRA rows, IA3 alone or on o's input, scored prompt positions, or more tokens than the largest
bucket run eagerly.

Beside them, one small graph per (padded batch size, greedy or not) draws a step's samples
again under its token masks (structured outputs: ModelRunner.sample with `masked`): a copy of
the logits that the step's graph left, the mask kernel on the rows whose flag (`mask_rows`)
is set, the sampler. A step with constrained requests replays its decode graph, then this one."""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplex.engine.step_inputs import FLORA_ROW_BUCKETS, StepShape

if TYPE_CHECKING:
    from loraplex.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


MIXED_TOKEN_BUCKETS = (64, 128, 256, 512, 1024)
"""Token counts of the mixed-step graphs: past about 1,024 tokens a step's kernels take longer
than its launches (the H100, Llama-3-8B: 1,024 tokens are about 16 TFLOP, 25 ms)."""
MIXED_SEQ_BUCKETS = (8, 32, 128)
"""Sequence counts of the mixed-step graphs (with max_batch): a step's sample rows are padded to
one (each padding row computes logits that are thrown away)."""


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8, up to max_batch (included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 8))
    return sizes + [max_batch]


@dataclass(frozen=True)
class CaptureReport:
    num_graphs: int
    batch_sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int
    """Device memory the graphs hold (their pool), beyond their static outputs."""
    output_bytes: int


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, vocab_size: int, capture: bool = True,
                 flora: bool = True, mixed: bool = False) -> None:
        """Without `capture` (CPU) padded steps run the same forward eagerly, so the padding is
        tested where no GPU is present. Without `flora` no graph has FLoRA rows (such steps run
        eagerly). With `mixed`, steps that compute prompt tokens are padded and captured too."""
        self.runner, self.capture, self.flora = runner, capture, flora
        self.sizes = graph_batch_sizes(max_batch)
        self.mixed_tokens = [t for t in MIXED_TOKEN_BUCKETS if t <= runner.inputs.max_tokens] if mixed else []
        self.mixed_seqs = sorted({s for s in MIXED_SEQ_BUCKETS if s < max_batch} | {max_batch})
        device = runner.device
        # Outputs live in static buffers, so the graphs' temporaries can share one pool.
        self.logits = torch.zeros(max_batch, vocab_size, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._masked: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.report: CaptureReport | None = None
        self.num_mixed_replays = 0
        """Steps with prompt tokens that replayed a graph."""

    def padded_size(self, num_seqs: int) -> int | None:
        """The graph batch size a decode step of `num_seqs` sequences runs at (None: too big)."""
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def mixed_padding(self, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
        """The padded (tokens, sequences) of the graph that a step computing prompt tokens runs
        (None: none, it runs eagerly): the fewest sequences that hold its own, then the fewest
        tokens that hold its own and one for each padding sequence."""
        if not self.mixed_tokens:
            return None
        seqs = next((s for s in self.mixed_seqs if s >= num_seqs), None)
        if seqs is None:
            return None
        tokens = next((t for t in self.mixed_tokens if t >= num_tokens + seqs - num_seqs and t > seqs), None)
        return None if tokens is None else (tokens, seqs)

    def has(self, shape: StepShape) -> bool:
        return shape.graph_key in self._graphs

    def replay(self, shape: StepShape) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [size, vocab], tokens [size]) of a filled padded step (size: its sequences)."""
        self._graphs[shape.graph_key].replay()
        self.num_mixed_replays += shape.is_padded_mixed
        return self.logits[:shape.num_seqs], self.tokens[:shape.num_seqs]

    def has_masked(self, shape: StepShape) -> bool:
        return (shape.num_seqs, shape.is_greedy) in self._masked

    def replay_masked(self, shape: StepShape) -> torch.Tensor:
        """tokens [size] of a padded decode step whose graph has run, drawn again under the
        masks that the step inputs hold (`StepInputs.fill_masks`)."""
        self._masked[shape.num_seqs, shape.is_greedy].replay()
        return self.tokens[:shape.num_seqs]

    def capture_all(self) -> CaptureReport | None:
        """Capture every graph; the step inputs hold padding meanwhile (nothing is stored)."""
        if not self.capture:
            return None
        device = self.runner.device
        torch.cuda.synchronize(device)
        started, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
        relay = (False, True) if self.runner.inputs.relay.mode != "off" else (False,)
        for tokens in reversed(self.mixed_tokens):  # the largest first: the others reuse its pool
            for seqs in reversed(self.mixed_seqs):
                if seqs >= tokens:
                    continue
                for has_lora in (False, True):
                    for is_greedy in (False, True):
                        shape = self.runner.inputs.fill_dummy_mixed(tokens, seqs, is_greedy, has_lora)
                        self.runner.inputs.upload()
                        self._graphs[shape.graph_key] = self._capture(shape)
        for size in reversed(self.sizes):
            for variant in self.variants(size):
                for is_greedy in (False, True):
                    for has_relay in relay if size >= 2 else (False,):
                        shape = self.runner.inputs.fill_dummy(
                            size, 1, adapter_slot=0, is_greedy=is_greedy, has_relay=has_relay,
                            **variant)
                        self.runner.inputs.upload()
                        self._graphs[shape.graph_key] = self._capture(shape)
            for is_greedy in (False, True):  # mask rows are -1 (none) in the step inputs meanwhile
                shape = self.runner.inputs.fill_dummy(size, 1, adapter_slot=0, is_greedy=is_greedy,
                                                      has_lora=False)
                self.runner.inputs.upload()
                self._masked[size, is_greedy] = self._capture(shape, self._run_masked)
        torch.cuda.synchronize(device)
        self.report = CaptureReport(
            num_graphs=len(self._graphs) + len(self._masked), batch_sizes=tuple(self.sizes),
            seconds=time.perf_counter() - started,
            pool_bytes=torch.cuda.memory_reserved(device) - reserved,
            output_bytes=self.logits.numel() * 4 + self.tokens.numel() * 8)
        logger.info("captured %d decode graphs (batch sizes %d to %d, with and without adapters, "
                    "greedy and sampling, and masked sampling%s) in %.1f s; they hold %.0f MiB",
                    self.report.num_graphs, self.sizes[0], self.sizes[-1],
                    f"; and steps with prompt tokens up to {self.mixed_tokens[-1]} tokens"
                    if self.mixed_tokens else "", self.report.seconds,
                    (self.report.pool_bytes + self.report.output_bytes) / 2**20)
        return self.report

    def variants(self, size: int) -> list[dict]:
        """fill_dummy's adapter switches of every graph of a batch size (greedy or not aside)."""
        plain = [dict(has_lora=False), dict(has_lora=True, has_expand=False),
                 dict(has_lora=True, has_expand=True), dict(has_lora=True, has_input_scale=True)]
        if not self.flora:
            return plain
        max_rows = size * self.runner.lora.max_rank
        buckets = [b for i, b in enumerate(FLORA_ROW_BUCKETS)
                   if i == 0 or FLORA_ROW_BUCKETS[i - 1] < max_rows]
        # FLoRA with the expand scales o's and down's inputs too (by 1 for adapters without IA3's
        # input vectors): one graph for FLoRA beside LoRA, DoRA or IA3, or the steps that mix
        # IA3 and FLoRA would run eagerly (9.5x the no-adapter step at batch 16 on the H100).
        return plain + [dict(has_lora=True, flora_rows=rows, **switches) for rows in buckets
                        for switches in (dict(has_expand=False), dict(has_expand=True, has_input_scale=True))]

    def _run(self, shape: StepShape) -> None:
        logits, tokens, _ = self.runner.forward(shape)
        self.logits[:shape.num_seqs].copy_(logits)
        self.tokens[:shape.num_seqs].copy_(tokens)

    def _run_masked(self, shape: StepShape) -> None:
        n = shape.num_seqs
        self.tokens[:n].copy_(self.runner.sample(shape, self.logits[:n], masked=True))

    def _capture(self, shape: StepShape, run=None) -> torch.cuda.CUDAGraph:
        run = run or self._run
        with torch.inference_mode():
            run(shape)  # compile every kernel before capture
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                run(shape)
        logger.debug("captured decode graph%s: batch %d, lora %s, greedy %s, input scale %s, expand %s, "
                     "flora rows %d, relay %s", " (masked sampling)" if run != self._run else "",
                     *shape.graph_key)
        return graph
