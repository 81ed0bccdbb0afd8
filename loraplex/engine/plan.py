"""The contract between scheduler and model runner: one StepPlan goes in, one StepResult comes
back. Plain data; the runner keeps its own per-request arrays and never touches the
scheduler's objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.types import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class NewSequence:
    """A request the runner has not seen since it was (re)admitted: everything it needs to
    keep the request's state. A request resumed after preemption comes again as new: its
    cache recomputed from all its tokens, or (swapped) copied back into `block_ids` with
    `num_computed_tokens` kept."""

    request_id: str
    token_ids: list[int]
    """Prompt and the tokens generated before any preemption."""
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    adapter_slot: int
    params: SamplingParams
    seed: int
    num_dropped_tokens: int = 0
    """Tokens its sliding window dropped (attention sinks): its blocks hold the rest."""


@dataclass
class TokenMasks:
    """The tokens that the step's constrained samples may draw (structured outputs): one
    bitmask row per request, from its grammar matcher."""

    request_ids: list[str]
    bitmask: Any
    """torch.Tensor [len(request_ids), ceil(vocab / 32)] int32 on the host: bit j of word i
    set allows token 32 i + j."""


@dataclass
class StepPlan:
    """One engine step. `request_ids[i]` computes `num_scheduled_tokens[i]` new tokens starting
    at its current `num_computed_tokens`; a request whose step reaches the end of its known
    tokens samples one more (`samples[i]`)."""

    new: list[NewSequence] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    """Blocks appended since the previous step, for requests that are not new."""
    dropped_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Attention sinks: request -> (index in its block list, count) of window blocks dropped
    before this step; the blocks after them move up, their keys rotated back by the tokens
    dropped (loraplex/engine/streaming.py). Applied before `new_block_ids`."""
    forgotten_ids: list[str] = field(default_factory=list)
    """Requests the runner must drop (finished, aborted or preempted since the last plan)."""
    num_preempted: int = 0
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, host block) pairs to copy to the host pool before this step writes any
    block (the device blocks are free for reuse from this step on)."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block, device block) pairs to copy back; the requests they belong to run from the
    next step on, so the copies overlap this step."""
    receive: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    """Disaggregated decode: request -> (index of its first block to fill, blocks) that its KV,
    computed on the prefill engine, is received into before the next step; it computes from
    then on."""
    token_masks: TokenMasks | None = None
    """Allowed tokens of the samples that are constrained (None: none is)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be records to update or blocks to copy)."""
        return not self.request_ids

    @property
    def has_work(self) -> bool:
        """Anything for the runner: tokens to compute, records to update or blocks to copy."""
        return bool(self.request_ids or self.forgotten_ids or self.new or self.swap_out or self.swap_in
                    or self.receive)


@dataclass
class StepResult:
    """What one step produced: a token for every request that sampled, in plan order."""

    sampled_ids: list[str] = field(default_factory=list)
    sampled_tokens: list[int] = field(default_factory=list)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    """Request id -> (prompt index of the first entry, entries): the prompt tokens the step
    scored, for requests that asked (a request recomputed after preemption scores again)."""
    device_s: float | None = None
    """With the runner's `time_steps`: the step's time on the device (CUDA events from its
    start on the stream to its results; on CPU the launch's own time), else None."""
