"""A worker process: rank `rank` of a tensor-parallel group. It joins the group, then answers
the driver's commands in order, one reply each, until Shutdown or until the driver's end of
the pipe closes. Every rank runs every step (the collectives need them all) and keeps its own
runner records; rank 0 returns the sampled tokens."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from loraplex.engine.lora_weights import HostAdapter, LoraSlotBuffers
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.relay_groups import RelayRule
from loraplex.engine.sizing import resolve_dtype
from loraplex.kernels import select_ops
from loraplex.model.model_config import ModelConfig
from loraplex.parallel.collectives import TensorParallelGroup
from loraplex.parallel.loader import load_model_shard
from loraplex.parallel.sharding import ShardLayout
from loraplex.worker.adapters import dora_row_scales, shard_host_adapter
from loraplex.worker.commands import LoadAdapter, LoadModel, RunnerSpec, RunStep, Shutdown
from loraplex.worker.replies import Done, Failed, StepOutput


def run_worker(rank: int, world_size: int, init_method: str, conn: Connection, timeout_s: float,
               num_threads: int) -> None:
    """The process's entry point (spawned by TensorParallelWorkers)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (issue 22)
    torch.set_num_threads(num_threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    worker = Worker(TensorParallelGroup(rank, world_size))
    try:
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # the driver is gone
                return
            if isinstance(command, Shutdown):
                conn.send(Done(rank))
                return
            try:
                reply = Done(rank, worker.handle(command))
            except Exception:  # noqa: BLE001 (the driver re-raises it, with the rank)
                reply = Failed(rank, traceback.format_exc())
            conn.send(reply)
    finally:
        dist.destroy_process_group()


class Worker:
    """One rank's model shard, KV cache, adapter slots and runner."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.layout: ShardLayout | None = None
        self.runner: ModelRunner | None = None

    def handle(self, command: LoadModel | LoadAdapter | RunStep) -> object:
        if isinstance(command, LoadModel):
            return self.load_model(command.spec)
        if self.runner is None:
            raise RuntimeError(f"{type(command).__name__} before LoadModel")
        if isinstance(command, LoadAdapter):
            self.load_adapter(command.slot, command.adapter)
            return None
        if isinstance(command, RunStep):
            return self.run_step(command)
        raise TypeError(f"unknown command {command!r}")

    def load_model(self, spec: RunnerSpec) -> dict[str, tuple[int, ...]]:
        """Build the rank's shard and its runner; returns the shard's parameter shapes."""
        device = torch.device(spec.device)
        if device.type != "cpu":
            raise NotImplementedError("tensor-parallel workers run on CPU (gloo) only so far")
        dtype = resolve_dtype(spec.dtype, device)
        config = ModelConfig.load(spec.model)
        layout = ShardLayout(config, self.group.rank, self.group.world_size)
        ops = select_ops(device)
        self.runner = None  # the old shard's memory goes before the new one is read
        model = load_model_shard(spec.model, layout, ops, dtype, device, spec.max_model_len, self.group)
        shard = layout.shard_config
        kv_cache = torch.zeros(spec.num_kv_blocks, shard.num_layers, 2, spec.block_size, shard.num_kv_heads,
                               shard.head_dim, dtype=dtype, device=device)
        lora = LoraSlotBuffers(shard, spec.num_lora_slots, spec.max_lora_rank, dtype, device,
                               base_weights=model.group_weights)
        self.layout = layout
        self.runner = ModelRunner(model, kv_cache, lora, ops, spec.max_num_seqs, spec.max_num_batched_tokens,
                                  spec.max_model_len, num_host_blocks=spec.num_host_blocks,
                                  relay=RelayRule(spec.relay_attention))
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        shapes["kv_cache"] = tuple(kv_cache.shape)
        return shapes

    def load_adapter(self, slot: int, adapter: HostAdapter) -> None:
        """Copy the rank's shard of `adapter` into `slot`; a DoRA adapter's o and down scales
        are then set from its row norms over every rank's columns."""
        shard, lora = shard_host_adapter(adapter, self.layout), self.runner.lora
        lora.load(slot, shard)
        if shard.family != "dora":
            return
        base_weights = self.runner.model.group_weights
        for name, scale in dora_row_scales(shard, base_weights, self.group).items():
            lora.scale[name][:, slot].copy_(scale)
            if name in lora.shift:  # o's bias: y <- scale (W0 x + delta) + bias (rank 0 holds it)
                bias = torch.stack([base_weights(layer, name)[1] for layer in range(len(scale))])
                lora.shift[name][:, slot].copy_((1 - scale) * bias.float())

    def run_step(self, command: RunStep) -> StepOutput | None:
        runner, logits = self.runner, []
        if (command.plan.swap_out or command.plan.swap_in) and runner.swapper is None:
            raise ValueError("the plan swaps KV blocks, but the workers have no host pool "
                             "(num_host_blocks 0)")
        is_driver_rank = self.group.rank == 0
        runner.on_logits = (lambda ids, step_logits: logits.append(step_logits.clone())) \
            if command.return_logits and is_driver_rank else None
        result = runner.collect(runner.launch(command.plan))
        if not is_driver_rank:
            return None
        return StepOutput(result, logits[0] if logits else None)
