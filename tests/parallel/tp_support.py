"""Run the single-process engine and record what it hands its runner (adapter slot loads and
step plans, in order) with each step's tokens and logits, to replay into tensor-parallel
workers."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.engine.lora_weights import HostAdapter
from loraplex.engine.plan import StepPlan, StepResult
from loraplex.worker.commands import RunnerSpec
from tests.factories import hf_config, save_byte_tokenizer

ARCHS = {
    "llama": {},  # 4 query heads, 2 KV heads: 2 and 1 a rank
    "qwen2": {"vocab_size": 301},  # q/k/v biases, tied embeddings, a vocabulary padded to 302
    "mistral": {"num_key_value_heads": 1},  # the one KV head replicated on both ranks
}
SYSTEM = list(range(40, 72))  # a shared prompt prefix of two blocks


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared CPU: one thread is 20x faster than two contended ones (a
    single-process step fell from 0.37 s to 0.02 s); the workers run one thread each too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_tiny_model(arch: str, folder: Path, **overrides):
    """A random tiny model of `arch` (tests.factories' shapes, with `overrides`) saved to
    `folder`; returns the transformers model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides)).eval()
    with torch.no_grad():  # qwen2 biases start at zero; make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(folder)
    save_byte_tokenizer(folder)
    return model


@dataclass
class RecordedStep:
    plan: StepPlan
    result: StepResult | None = None
    logits: torch.Tensor | None = None


@dataclass
class Recording:
    events: list[tuple[int, HostAdapter, list[int]] | RecordedStep] = field(default_factory=list)
    """Slot loads (slot, adapter, pool pages) and steps, in the order the runner saw them."""

    @property
    def steps(self) -> list[RecordedStep]:
        return [e for e in self.events if isinstance(e, RecordedStep)]


def record(engine) -> Recording:
    """Record the slot loads and steps of `engine` (synchronous scheduling) from now on."""
    recording, runner, lora = Recording(), engine.runner, engine.lora
    # where a step's plan enters the runner: `begin` where structured outputs split the launch
    # in two (begin, then finish with the masks), else `launch`
    entry = "begin" if hasattr(runner, "begin") else "launch"
    load, start, collect = lora.load, getattr(runner, entry), runner.collect

    def recording_load(slot: int, adapter: HostAdapter, pages: list[int]) -> None:
        recording.events.append((slot, adapter, list(pages)))
        load(slot, adapter, pages)

    def recording_start(plan: StepPlan, *args, **kwargs):
        step = RecordedStep(copy.deepcopy(plan))
        recording.events.append(step)
        runner.on_logits = lambda ids, logits: setattr(step, "logits", logits.clone())
        return start(plan, *args, **kwargs)

    def recording_collect(launched):
        result = collect(launched)
        recording.steps[-1].result = result
        return result

    lora.load, runner.collect = recording_load, recording_collect
    setattr(runner, entry, recording_start)
    return recording


def runner_spec(engine) -> RunnerSpec:
    """The runner sizes of `engine`, for workers to build the same runner on their shards."""
    config = engine.config
    return RunnerSpec(
        model=config.model, dtype="float32", device="cpu", max_model_len=engine.max_model_len,
        num_kv_blocks=engine.memory.num_pool_blocks, block_size=config.cache.block_size,
        num_lora_slots=engine.memory.num_lora_slots, max_lora_rank=config.lora.max_lora_rank,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        relay_attention=config.relay_attention,
        num_host_blocks=0 if engine.runner.swapper is None else len(engine.runner.swapper.host))


def replay(workers, recording: Recording) -> list[RecordedStep]:
    """Send the recorded loads and steps to `workers`; their steps (tokens and logits). Each
    step is launched before the one before it is collected (as async scheduling will)."""
    replayed, launched = [], []

    def collect_one() -> None:
        plan, output = launched.pop(0), workers.collect()
        replayed.append(RecordedStep(plan, output.result, output.logits))

    for event in recording.events:
        if isinstance(event, RecordedStep):
            workers.launch(event.plan, return_logits=True)
            launched.append(event.plan)
            if len(launched) == 2:
                collect_one()
        else:
            while launched:  # a slot load waits for the steps in flight
                collect_one()
            slot, adapter, _ = event  # the ranks' adapters have a pool of their own (runner_spec)
            workers.load_adapter(slot, adapter)
    while launched:
        collect_one()
    return replayed
