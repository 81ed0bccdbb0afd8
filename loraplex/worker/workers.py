"""The driver's side: spawn one worker process per rank, send each command to all of them,
wait for every reply. The engine core will sit behind this interface (StepPlan in,
StepResult out, adapter slot loads), as vLLM V1's engine core sits behind its executor:
every rank gets the same command (vLLM: a shared-memory broadcast queue; here one pipe a
rank), every rank runs the model on its shard, rank 0 answers with the tokens.

Every rank acknowledges every command, so that a failure or a dead process on any rank is
seen at once; after one the group is torn down (a rank left inside a collective cannot be
recovered) and WorkerError raised."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from loraplex.engine.lora_weights import HostAdapter
from loraplex.engine.plan import StepPlan
from loraplex.errors import ModelLoadError
from loraplex.model.model_config import ModelConfig
from loraplex.parallel.sharding import check_tensor_parallel
from loraplex.worker.commands import (
    LoadAdapter,
    LoadModel,
    MapAdapterRing,
    MapPeerKv,
    MeasureMemory,
    PushKv,
    ReceiveKv,
    RunnerSpec,
    RunStep,
    ShareKv,
    Shutdown,
    TimeCollectives,
)
from loraplex.worker.process import NO_MULTICAST_ENV, run_worker
from loraplex.worker.replies import Done, Failed, KvHandle, MemoryReport, StepOutput

DEFAULT_TIMEOUT_S = 300.0
"""How long a command, and a collective inside a worker, may take before it counts as hung."""
STOP_GRACE_S = 10.0
"""How long closing waits for a worker to exit before it is terminated, then killed."""


def check_workers(config: ModelConfig, world_size: int, device: torch.device) -> None:
    """Raise ModelLoadError unless `config` splits over `world_size` ranks and, on CUDA, there
    are that many GPUs (before any weight is read)."""
    check_tensor_parallel(config, world_size)
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ModelLoadError(f"tensor_parallel_size {world_size} needs as many GPUs; "
                             f"{torch.cuda.device_count()} present", param="tensor_parallel_size")


class WorkerError(RuntimeError):
    """A worker failed, died or hung; the workers have been stopped."""


class TensorParallelWorkers:
    """`world_size` worker processes (spawned) in one process group (gloo on CPU, NCCL on
    GPUs: rank r on cuda:r). Use as a context manager, or call `close()`: the processes are
    stopped on every path out."""

    def __init__(self, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 num_threads: int = 1, backend: str = "gloo", shared: SharedGroup | None = None) -> None:
        """`num_threads`: torch's CPU threads in each worker; `backend`: "gloo" or "nccl".
        `shared`: these workers are ranks [first, first + world_size) of a larger process group
        (spawn_disaggregated), their model's tensor-parallel group their own (of size 1)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, not {backend!r}")
        if shared is not None and world_size != 1:
            raise NotImplementedError("workers in a shared process group hold a whole model each (size 1)")
        self.world_size, self.timeout_s, self.backend = world_size, timeout_s, backend
        self.first_rank = shared.first_rank if shared is not None else 0
        """The global rank of this group's rank 0 (its peers address it by that)."""
        # The rendezvous is a file, not a port: nothing to choose, nothing to collide with.
        self._store_dir = shared.store_dir if shared is not None else tempfile.mkdtemp(prefix="loraplex-tp-")
        init_method = f"file://{os.path.join(self._store_dir, 'store')}"
        total = shared.total_ranks if shared is not None else world_size
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._processes: list[Any] = []
        # One entry a command sent and not yet answered, in order: True for a step that
        # `collect` returns; for a queued command, the call that takes rank 0's answer, or
        # False where its acknowledgements are only checked for failures.
        self._pending: deque[bool | Callable[[Any], None]] = deque()
        os.environ.update(NO_MULTICAST_ENV)  # the spawned children inherit it; they set it again
        try:
            for rank in range(world_size):
                parent, child = context.Pipe()
                global_rank = self.first_rank + rank
                process = context.Process(
                    target=run_worker, name=f"loraplex-worker-{global_rank}", daemon=True,
                    args=(global_rank, total, init_method, child, timeout_s, num_threads, backend,
                          (rank, world_size), shared is not None))
                process.start()
                child.close()  # the child's end lives in the child only: its death closes the pipe
                self._conns.append(parent)
                self._processes.append(process)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TensorParallelWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_closed(self) -> bool:
        return not self._conns

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def load_model(self, spec: RunnerSpec) -> list[dict[str, tuple[int, ...]]]:
        """Every rank builds its shard; returns each rank's parameter shapes. A model that does
        not split over the ranks, or more ranks than GPUs, is refused here, before any worker
        reads the model (ModelLoadError)."""
        check_workers(ModelConfig.load(spec.model), self.world_size, torch.device(spec.device))
        return self._call(LoadModel(spec))

    def measure_memory(self, spec: RunnerSpec, gpu_memory_utilization: float) -> list[MemoryReport | None]:
        """Every rank loads its shard (kept for `load_model` of the same model) and measures
        the memory a step takes beside it (CUDA; None on CPU)."""
        check_workers(ModelConfig.load(spec.model), self.world_size, torch.device(spec.device))
        return self._call(MeasureMemory(spec, gpu_memory_utilization))

    def load_adapter(self, slot: int, adapter: HostAdapter, pages: list[int] | None = None,
                     ring: tuple[int, int] | None = None) -> None:
        """Copy an adapter (laid out for the full model) into `slot` on every rank, each its
        shard, in pool `pages` (None: the slot's own, where the ranks' adapters have a pool of
        their own); `ring` as for `queue_adapter`."""
        self._call(LoadAdapter(slot, adapter, None if pages is None else tuple(pages), ring))

    def time_collectives(self, batch_sizes: tuple[int, ...], iterations: int = 50) -> list[dict[str, float]]:
        """Rank 0's timings of a decode step's collectives at each batch size (TimeCollectives)."""
        return self._call(TimeCollectives(tuple(batch_sizes), iterations))[0]

    def queue_adapter(self, slot: int, adapter: HostAdapter, pages: list[int] | None = None,
                      ring: tuple[int, int] | None = None,
                      on_done: Callable[[Any], None] | None = None) -> None:
        """Send a slot load to every rank and return at once: the ranks run it after the steps
        launched before it and before those launched after (their commands run in order); a
        failure is raised by the next `collect`. `ring`: where in the adapter ring its packed
        pages are (LoadAdapter.ring); `on_done` as for `queue`."""
        self._guarded(self._send, LoadAdapter(slot, adapter, None if pages is None else tuple(pages), ring))
        self._pending.append(on_done or False)

    def map_adapter_ring(self, ring: torch.Tensor) -> None:
        """Every rank keeps `ring` (shared host memory) as its adapter ring (MapAdapterRing)."""
        self._call(MapAdapterRing(ring))

    def share_kv(self, staging_blocks: int = 0) -> KvHandle:
        """Rank 0's KV cache, or a staging area of `staging_blocks` it makes now, as another
        worker on the machine maps it (workers of a shared process group: spawn_disaggregated)."""
        return self._call(ShareKv(staging_blocks))[0]

    def map_peer_kv(self, handle: KvHandle, staging: bool = False) -> None:
        """Map a peer's shared KV cache (for ReceiveKv) or staging area (for PushKv)."""
        self._call(MapPeerKv(handle, staging))

    def queue(self, command: PushKv | ReceiveKv, on_done: Callable[[Any], None] | None = None) -> None:
        """Send `command` to every rank and return at once, as queue_adapter does (it runs
        between the steps launched before and after it; a failure is raised by the next
        `collect`). `on_done(rank 0's answer)` is called when its replies are read: by the
        `collect` of the first step launched after it, at the latest."""
        self._guarded(self._send, command)
        self._pending.append(on_done or False)

    def execute(self, plan: StepPlan, return_logits: bool = False) -> StepOutput:
        """Run one step on every rank; rank 0's tokens (and logits, when asked)."""
        self.launch(plan, return_logits)
        return self.collect()

    def launch(self, plan: StepPlan, return_logits: bool = False, *, want_reply: bool = True) -> None:
        """Queue a step on every rank and return at once: the driver may plan and launch the
        next before it collects this one (the ranks run their commands in order). Without
        `want_reply` (a plan that samples nothing) `collect` skips its output, raising only its
        failure."""
        self._guarded(self._send, RunStep(plan, return_logits))
        self._pending.append(want_reply)

    def collect(self) -> StepOutput:
        """The oldest launched step's output (waits for it, and for the adapter loads queued
        before it)."""
        if True not in self._pending:
            raise RuntimeError("no step launched")
        while (entry := self._pending.popleft()) is not True:
            self._acknowledged(entry)
        return self._guarded(self._replies)[0]

    def _acknowledged(self, entry: bool | Callable[[Any], None]) -> None:
        """Read the replies of a queued command (one not collected) and hand rank 0's answer to
        its `on_done`, if any."""
        answers = self._guarded(self._replies)
        if callable(entry):
            entry(answers[0])

    def acknowledge_queued(self) -> None:
        """Wait for the replies of the queued commands at the head of the queue (up to the
        first step launched, which `collect` reads) and hand each to its `on_done`."""
        while self._pending and self._pending[0] is not True:
            self._acknowledged(self._pending.popleft())

    def read_acknowledgements(self) -> None:
        """Read the replies of the unread commands at the head of the queue that every rank has
        answered already (never waits), so they do not pile up in the pipes."""
        while self._pending and self._pending[0] is not True and all(conn.poll() for conn in self._conns):
            self._acknowledged(self._pending.popleft())

    @property
    def num_launched(self) -> int:
        """Steps launched and not yet collected."""
        return sum(entry is True for entry in self._pending)

    def _call(self, command: Any) -> list[Any]:
        """Send `command` to every rank; their answers in rank order."""
        if self.num_launched:
            raise RuntimeError(f"collect the {self.num_launched} launched steps first")
        while self._pending:  # queued commands: their failures surface here
            self._acknowledged(self._pending.popleft())
        self._guarded(self._send, command)
        return self._guarded(self._replies)

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """fn(*args); on any failure the workers are stopped and the error raised."""
        if not self._conns:
            raise WorkerError("the workers are stopped")
        try:
            return fn(*args)
        except BaseException:
            self.close(grace_s=1.0)  # a rank may be stuck in a collective: no long wait
            raise

    def _send(self, command: Any) -> None:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(command)
            except OSError:  # the pipe's other end is gone
                raise self._died(rank) from None

    def _replies(self) -> list[Any]:
        answers: dict[int, Any] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready = wait(list(pending), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                silent = sorted(pending.values())
                raise WorkerError(f"ranks {silent} gave no answer in {self.timeout_s:.0f} s")
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    reply = conn.recv()
                except (EOFError, OSError):  # closed, or reset by the dying process
                    raise self._died(rank) from None
                if isinstance(reply, Failed):
                    raise WorkerError(f"worker rank {reply.rank} failed:\n{reply.error}")
                assert isinstance(reply, Done)
                answers[rank] = reply.value
        return [answers[rank] for rank in range(self.world_size)]

    def _died(self, rank: int) -> WorkerError:
        process = self._processes[rank]
        process.join(1)
        hint = ("; a script that starts workers needs an `if __name__ == \"__main__\":` guard (they are "
                "spawned, and import the script again)") if process.exitcode == 1 else ""
        return WorkerError(f"worker rank {rank} died (exit code {process.exitcode}){hint}")

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every worker (Shutdown; after `grace_s`, terminate; then kill); idempotent."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):  # already gone
                conn.send(Shutdown())
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.join(max(deadline - time.monotonic(), 0.1))
        for process in self._processes:
            if process.is_alive():
                process.terminate()
                process.join(2)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._processes = [], []
        self._pending.clear()
        shutil.rmtree(self._store_dir, ignore_errors=True)


@dataclass(frozen=True)
class SharedGroup:
    """A process group that several engines' workers join (spawn_disaggregated)."""

    store_dir: str
    first_rank: int
    total_ranks: int


def spawn_disaggregated(
    num_prefill: int, num_decode: int, *, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
    num_threads: int = 1,
) -> tuple[list[TensorParallelWorkers], list[TensorParallelWorkers]]:
    """One worker process for each prefill and each decode engine, all in one process group
    (prefill workers first: global ranks 0..P-1, then the decode workers; with NCCL, rank r on
    cuda:r), each keeping its KV cache where the others can map it (ShareKv, MapPeerKv: a prefill
    worker pushes blocks into a decode worker's staging area, PushKv, or a decode worker copies
    them out of a prefill worker's cache, ReceiveKv). Each holds a whole model; each engine
    drives its own through a TensorParallelWorkers of size 1."""
    total, made = num_prefill + num_decode, []
    if backend == "nccl" and total > torch.cuda.device_count():
        raise ModelLoadError(f"{num_prefill} prefill and {num_decode} decode workers need as many GPUs; "
                             f"{torch.cuda.device_count()} present", param="disaggregate")
    store_dir = tempfile.mkdtemp(prefix="loraplex-pd-")
    try:
        for rank in range(total):
            made.append(TensorParallelWorkers(1, timeout_s=timeout_s, num_threads=num_threads,
                                              backend=backend, shared=SharedGroup(store_dir, rank, total)))
    except BaseException:
        for workers in made:
            workers.close()
        shutil.rmtree(store_dir, ignore_errors=True)
        raise
    return made[:num_prefill], made[num_prefill:]
