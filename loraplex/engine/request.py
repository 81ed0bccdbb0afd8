"""A request's life in the engine. Pure Python (no torch): the scheduler's state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.tenants import DEFAULT_TENANT
from loraplex.types import FinishReason, SamplingParams, StreamingWindow, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    """The request's own seed, or one drawn at arrival: sampling noise depends only on
    (seed, token index), so a preempted request resumes with the same output."""
    arrival: int
    """Arrival order (first come, first served orders by it)."""
    tenant: str = DEFAULT_TENANT
    adapter: str | None = None
    """The adapter's digest (its identity), None for the base model."""
    adapter_name: str | None = None
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by every generated token."""
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache (or being computed by a step in flight)."""
    num_pending: int = 0
    """Tokens sampled by steps still in flight: the device has them, token_ids not yet."""
    max_num_tokens: int = 2**62
    """Prompt + generated tokens at which the request ends by length (max_tokens or the
    model's context, whichever comes first)."""
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    adapter_wait_s: float = 0.0
    """Seconds it has waited in the queue for its adapter (a host load, a slot copy, a slot)."""
    adapter_wait_since: float | None = None
    """When its current wait for its adapter began (None: not waiting for it)."""
    host_block_ids: list[int] = field(default_factory=list)
    """Host-pool blocks holding a copy of this request's KV (swapped out, or kept after a
    swap-in so that the next swap-out copies only what was written since)."""
    num_host_tokens: int = 0
    """Tokens whose K/V the host copy holds."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Prefix cache identities of the prompt's full blocks (empty with the cache off)."""
    num_swap_prefix_blocks: int = 0
    """Leading cached blocks that its host copy leaves out (they stay on the device, shared)."""
    num_prompt_charged: int = 0
    """Prompt tokens counted as service to the tenant (recomputing them is not counted again)."""
    prompt_donor: Request | None = None
    """Another sample of the same prompt (same tokens and adapter) whose full prompt blocks this
    one takes references to instead of computing them (OpenAI's `n`)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """One entry per prompt token scored so far (None for the first), when asked."""
    streaming: StreamingWindow | None = None
    """Attention sinks and a sliding window (its own or the engine's): the KV keeps only those,
    and the request may run past the context (see loraplex/engine/streaming.py)."""
    num_dropped_tokens: int = 0
    """With `streaming`: tokens of the window dropped from the cache (whole blocks)."""
    documents: Any = None
    """A DocumentBlend (loraplex.engine.blending) still to run under the request's adapter,
    once the adapter is in a device slot: the scheduler leaves the request waiting until then."""
    matcher: Any = None
    """With `params.structured`: its GrammarMatcher (loraplex.engine.grammar), advanced by each
    token committed. Never ahead of `token_ids`: a constrained request is planned only once its
    tokens are all on the host, so preemption (recompute or swap) leaves it where it is."""
    is_prefill_only: bool = False
    """Disaggregated prefill: the request computes its prompt and samples its first token on this
    engine, then leaves it with its KV blocks to decode on another (loraplex/engine/handoff.py)."""
    has_remote_kv: bool = False
    """Disaggregated decode: waiting with its computed tokens' KV on the prefill engine; once
    admitted it receives it into its blocks (StepPlan.receive) instead of computing it."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known to the scheduler: those in token_ids and those still in flight."""
        return len(self.token_ids) + self.num_pending

    @property
    def will_end_by_length(self) -> bool:
        """Every token it may generate is sampled already (some may still be in flight)."""
        return self.num_tokens >= self.max_num_tokens

    @property
    def has_tokens_to_compute(self) -> bool:
        """A generating request computes until it has sampled its last token (which nothing
        reads); one that only scores its prompt, until its whole prompt is in; a prefill-only one,
        until it has sampled its first token."""
        if self.params.is_scoring_only:
            return self.num_computed_tokens < self.num_tokens
        if self.is_prefill_only and self.num_tokens > self.num_prompt_tokens:
            return False
        return not self.will_end_by_length

    @property
    def num_cached_tokens(self) -> int:
        """Computed tokens whose K/V its blocks hold (all of them but those a window dropped)."""
        return self.num_computed_tokens - self.num_dropped_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_swapped(self) -> bool:
        """Waiting with its computed tokens' K/V in the host pool (none on the device)."""
        return self.status is RequestStatus.WAITING and self.num_computed_tokens > 0 and not self.block_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
