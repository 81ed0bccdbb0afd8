"""Engine options: frozen dataclasses, built once at the edge (`loraplex serve` flags, `LLM(...)`
keyword arguments) and passed down. Their fields are the one source of the options: the CLI's
flags, with their help, come from the fields and their docstrings (loraplex/cli/engine_flags.py),
`LLM(**options)` routes each keyword to the field of that name, and the admin engine API shows
them. Names follow vLLM's where one exists (`max_num_seqs` is `--max-num-seqs`). Values learned
at run time (the number of KV blocks, the eos id) live in other objects; nothing here is ever
written back."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal


class ConfigError(ValueError):
    """An option has a value it cannot take; `option` names it (the field)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option, self.message = option, message


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block (a power of two)."""
    num_kv_blocks: int | None = None
    """KV blocks to allocate, overriding the size computed from memory (vLLM's
    --num-gpu-blocks-override): the pool holds this many beside slot 0 and one adapter, or beside
    max_loras adapters (max_num_seqs without it) where the memory allows."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use: weights, activations, CUDA graphs,
    and in what is left the pool that the KV cache and the adapter slots share."""
    cpu_kv_cache_bytes: int = 1 << 30
    """The pool of KV blocks and adapter slots on CPU, in bytes, at most."""
    swap_space: float = 4.0
    """Host memory, in GiB, that preempted requests' KV is swapped to (pinned on CUDA); when it
    is full, or 0, a preempted request's KV is dropped and recomputed when it resumes."""

    enable_prefix_caching: bool = True
    """Find full prompt blocks again by content (chained over tokens, keyed by tenant and
    adapter): a request whose prompt starts with cached blocks shares them and prefills only
    the rest; blocks nobody holds stay cached until the free list runs dry (LRU)."""
    sliding_window: int | None = None
    """Attention sinks (StreamingLLM) for every request that sets no `streaming_window` of its
    own: its KV keeps the first attention_sinks tokens and the last this many, so that a session
    runs past the context in bounded memory (positions within the cache; window blocks that fall
    behind go back to the pool). None: off, requests end at the context."""
    attention_sinks: int = 4
    """With sliding_window: the first tokens whose KV is always kept (kept in whole blocks: 4
    keeps the first block); 0: a plain sliding window."""

    def __post_init__(self) -> None:
        _check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
               "block_size", "must be a power of two")
        _check(self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks", "must be positive")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        _check(self.cpu_kv_cache_bytes > 0, "cpu_kv_cache_bytes", "must be positive")
        _check(0 <= self.swap_space <= 1 << 20, "swap_space", "must be a number of GiB >= 0")
        _check(self.sliding_window is None or self.sliding_window > 0, "sliding_window",
               "must be positive (leave it out for no window)")
        _check(self.attention_sinks >= 0, "attention_sinks", "must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running at once (also the largest batch captured as a CUDA graph)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decodes first, then prompt chunks up to this many tokens."""
    scheduling_policy: Literal["vtc", "fcfs"] = "vtc"
    """Order of admission and choice of preemption victims: "vtc", fair between tenants by
    virtual token counters (service = prompt tokens + 2 x generated tokens, over the tenant's
    weight); "fcfs", first come, first served."""
    max_capped_prefill_tokens: int = 0
    """Prompt tokens a step may compute, all together, for the tenants the policy caps (VTC:
    those served more than `fairness_bound` beyond a tenant that decodes in the step), so that
    their long prompts do not stretch the steps, and the time between tokens, of the tenants
    behind them; 0: no cap (the default). The fairness simulation found 1,024 took light
    tenants' p99 time between tokens from 1.40-1.63x their own alone to 1.09-1.21x at
    0.996-1.001x throughput, but on the H100 (seed 0) it cost 15% of throughput and took their
    p99 TTFT from 1.39x to 3.64x for a time between tokens of 1.025x."""
    fairness_bound: float = 4096.0
    """With "vtc": how far (in weighted tokens of service) a waiting tenant may fall behind the
    most-served running tenant before one of that tenant's requests is preempted for it."""
    fairness_patience_tokens: int = 16
    """With "vtc": a waiting tenant kept out only by a lack of running places preempts nobody while
    a running request will end by length within this many generated tokens (steps): that place
    frees soon and goes to the first in line, and a preemption would cost the victim its place
    and a swap (0: preempt at once). In the H200 serving pass (1,000 adapters over 40 tenants at
    80% of one adapter's saturated rate) VTC preempted 121-126 requests a run for places that
    freed within a step or two, and the steps that did took 19.8 ms at p50 against 11.8."""
    fairness_kv_headroom: float = 0.0
    """With "vtc": the share of the KV cache that the most-served tenant's new and resuming
    requests leave free while it is more than `fairness_bound` ahead of another active tenant, so
    that the requests of the tenants behind it start in free blocks rather than by swapping its
    requests out (0: none, the default). Its running requests may still grow into it; once one
    of its requests does not fit, it starts no other in that step. In the fairness simulation
    (seeds 0-4, H100 step model, 1,536 tokens a step) 0.15625 (640 of 4,096 blocks) took light
    tenants' median p99 TTFT from 1.70x their own alone to 1.31x (2.05x to 1.45x with 256-token
    system prompts) and the median fairness preemptions from 296 and 407 a minute to 13 and 4,
    at 0.983x and 0.971x FCFS's throughput; off until measured on a GPU
    (studies/results/fairness-sim-sweep.md)."""
    hold_places_for_loading: bool = False
    """With "vtc": while the free running places are no more than the requests waiting for their
    adapters, a tenant that holds its weighted share of the places takes no more; so it does not
    take places that it loses again one fairness preemption at a time as those adapters arrive
    (a batch sent all at once: the slot simulation's 600 requests over 40 tenants, 204 -> 1
    fairness swaps with 32 slots and about 340 -> 0 with the pool, at 0.93-0.95x the simulated
    throughput, which does not count a swap's cost; off until measured on a GPU)."""

    scheduler_delay_factor: float = 1.0
    """Where pure decode steps replay CUDA graphs and a step that computes prompt tokens runs
    eagerly (CUDA), new prompts start only once the time since the last step that computed
    prompt tokens reaches this multiple of that step's duration (vLLM's name), so arrivals
    gather into fewer eager steps and the decodes in between replay graphs; 0: every prompt
    starts at the first step with room. No prompt waits when the step computes prompt tokens
    anyway (a running prompt's next chunk), when no request decodes, or when the waiting
    prompts would fill the step's budget; swapped requests resume without waiting. On the H100
    (Llama-3-8B shape, 64 rank-16 adapters) an eager step of 32 decodes and one 256-token
    prompt took 42.6 ms (its kernels 15 ms: the rest is host time), a graph replay of the
    32 decodes 8.9 ms (scripts/profile-mixed-steps.py)."""

    def __post_init__(self) -> None:
        _check(self.max_num_seqs > 0, "max_num_seqs", "must be positive")
        _check(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be positive")
        _check(self.scheduling_policy in ("vtc", "fcfs"), "scheduling_policy",
               f"must be vtc or fcfs, not {self.scheduling_policy!r}")
        _check(self.fairness_bound >= 0, "fairness_bound", "must be >= 0")
        _check(0.0 <= self.fairness_kv_headroom < 1.0, "fairness_kv_headroom", "must be in [0, 1)")
        _check(self.fairness_patience_tokens >= 0, "fairness_patience_tokens", "must be >= 0 (0: none)")
        _check(self.max_capped_prefill_tokens >= 0, "max_capped_prefill_tokens", "must be >= 0 (0: no cap)")
        _check(self.scheduler_delay_factor >= 0, "scheduler_delay_factor", "must be >= 0 (0: no delay)")


@dataclass(frozen=True)
class LoRAConfig:
    max_lora_rank: int = 64
    """Largest adapter rank accepted; device slots are this wide (kernels skip the padding)."""
    max_loras: int | None = None
    """Most adapters resident on the device at once, which is also the most distinct adapters
    in one step (vLLM's meaning). Default: no cap; adapters live in the pages of the memory
    pool that the KV cache is not using, as many as fit."""
    max_cpu_loras: int | None = None
    """Size of the host tier that device slots are filled from (pinned memory on CUDA), as
    this many adapters of max_lora_rank (in bytes: smaller adapters take less). Default: twice
    max_loras, or 64 without it."""
    flora_graphs: bool = False
    """Capture CUDA graphs of decode steps that carry FLoRA adapters (up to 3x the graphs and
    the start-up time: each batch size adds its FLoRA row counts, with and without LoRA beside
    them); off, such steps run eagerly (correct, slower). Turn on when serving FLoRA adapters."""

    def __post_init__(self) -> None:
        _check(self.max_lora_rank > 0, "max_lora_rank", "must be positive")
        _check(self.max_loras is None or self.max_loras > 0, "max_loras", "must be positive")
        _check(self.max_cpu_loras is None or self.max_cpu_loras > 0, "max_cpu_loras", "must be positive")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Path to a local Hugging Face model folder."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine runs: "auto" takes cuda when present."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weights and activations: "auto" is bfloat16 on CUDA, float32 on CPU."""
    max_model_len: int | None = None
    """Longest sequence, prompt and output (default: the model's max_position_embeddings)."""
    seed: int = 0
    """Seed for requests that set none of their own."""
    enforce_eager: bool = False
    """Run every step eagerly: capture no CUDA graphs (they are captured at start-up)."""
    mixed_step_graphs: bool = True
    """Capture CUDA graphs of steps that compute prompt tokens too (padded to up to 1,024 tokens;
    loraplex/engine/cuda_graphs.py), not only of pure decode steps: such steps otherwise run
    eagerly, bound by the host's kernel launches (on the H100, Llama-3-8B with 64 adapters, 32
    decodes and a 256-token prompt took 42.6 ms against 15 ms of kernels; the serving pass with
    1,000 adapters went from 2,378 to 4,404 output tokens/s offline with them). With them on, new
    prompts do not wait (scheduler_delay_factor applies only when they are off)."""
    async_scheduling: bool | None = None
    """Plan and launch each step while the device still runs the previous one, so the host's
    work hides behind the device's (default: on CUDA only, where it pays)."""
    kernels: Literal["auto", "triton", "reference"] = "auto"
    """Op set: "auto" is Triton on CUDA and the torch reference on CPU."""
    relay_attention: Literal["auto", "always", "off"] = "auto"
    """Decode steps read a prefix that several requests share (same cached blocks: same tenant,
    adapter and prompt start) once per group (RelayAttention): "auto" where measured to pay
    (prefix >= 2048 tokens and >= 4 requests, or >= 512 and >= 16); "always" for every group of
    two or more; "off" never."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (Megatron-style), one worker process each (vLLM's name):
    on CUDA one GPU a rank over NCCL, on CPU gloo (for tests). The attention heads, the KV heads
    (or, with fewer KV heads than ranks, the ranks by them) and the intermediate size must
    divide; checked before the model loads."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda"), "device",
               f"must be auto, cpu or cuda, not {self.device!r}")
        _check(self.dtype in ("auto", "float32", "float16", "bfloat16"), "dtype",
               f"must be auto, float32, float16 or bfloat16, not {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "must be positive")
        _check(self.kernels in ("auto", "triton", "reference"), "kernels",
               f"must be auto, triton or reference, not {self.kernels!r}")
        _check(self.relay_attention in ("auto", "always", "off"), "relay_attention",
               f"must be auto, always or off, not {self.relay_attention!r}")
        _check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
               "tensor_parallel_size", f"must be an integer >= 1, not {self.tensor_parallel_size!r}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (`block_size=32, max_loras=4, ...`), routing each to
        the sub-config that owns it. Unknown names raise TypeError; bad values ConfigError."""
        top_kwargs: dict[str, Any] = {}
        sub_kwargs: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        owners = option_owners()
        for key, value in kwargs.items():
            if key not in owners:
                raise TypeError(f"unknown engine option {key!r}")
            (top_kwargs if owners[key] is None else sub_kwargs[owners[key]])[key] = value
        sections = {name: section(**sub_kwargs[name]) for name, section in SECTIONS.items()}
        return cls(model=model, **top_kwargs, **sections)

    def options(self) -> dict[str, Any]:
        """Every option by its flat name (`max_num_seqs`, ...), the model folder left out."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in SECTIONS}
        flat.pop("model")
        for name in SECTIONS:
            section = getattr(self, name)
            flat.update({f.name: getattr(section, f.name) for f in fields(section)})
        return flat

    def with_options(self, **kwargs: Any) -> EngineConfig:
        """A copy with some options changed (flat names)."""
        return EngineConfig.from_kwargs(self.model, **{**self.options(), **kwargs})


SECTIONS: dict[str, type] = {"cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig}
"""EngineConfig's sub-configs by field name."""


def option_owners() -> dict[str, str | None]:
    """Each flat option name -> the EngineConfig field of the section that holds it (None: a
    field of EngineConfig itself). The model folder is not an option."""
    owners: dict[str, str | None] = {
        f.name: None for f in fields(EngineConfig) if f.name not in SECTIONS and f.name != "model"}
    for name, section in SECTIONS.items():
        owners.update({f.name: name for f in fields(section)})
    return owners


def _check(condition: bool, option: str, message: str) -> None:
    if not condition:
        raise ConfigError(option, message)
