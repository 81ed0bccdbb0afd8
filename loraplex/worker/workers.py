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
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from loraplex.engine.lora_weights import HostAdapter
from loraplex.engine.plan import StepPlan
from loraplex.errors import ModelLoadError
from loraplex.model.model_config import ModelConfig
from loraplex.parallel.sharding import check_tensor_parallel
from loraplex.worker.commands import LoadAdapter, LoadModel, RunnerSpec, RunStep, Shutdown
from loraplex.worker.process import run_worker
from loraplex.worker.replies import Done, Failed, StepOutput

DEFAULT_TIMEOUT_S = 300.0
"""How long a command, and a collective inside a worker, may take before it counts as hung."""
STOP_GRACE_S = 10.0
"""How long closing waits for a worker to exit before it is terminated, then killed."""


class WorkerError(RuntimeError):
    """A worker failed, died or hung; the workers have been stopped."""


class TensorParallelWorkers:
    """`world_size` worker processes (spawned) in one gloo process group. Use as a context
    manager, or call `close()`: the processes are stopped on every path out."""

    def __init__(self, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 num_threads: int = 1) -> None:
        """`num_threads`: torch's CPU threads in each worker."""
        self.world_size, self.timeout_s = world_size, timeout_s
        # The rendezvous is a file, not a port: nothing to choose, nothing to collide with.
        self._store_dir = tempfile.mkdtemp(prefix="loraplex-tp-")
        init_method = f"file://{os.path.join(self._store_dir, 'store')}"
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._processes: list[Any] = []
        self._num_launched = 0  # steps sent and not yet collected
        try:
            for rank in range(world_size):
                parent, child = context.Pipe()
                process = context.Process(target=run_worker, name=f"loraplex-tp-{rank}", daemon=True,
                                          args=(rank, world_size, init_method, child, timeout_s, num_threads))
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
        check_tensor_parallel(ModelConfig.load(spec.model), self.world_size)
        if torch.device(spec.device).type == "cuda" and self.world_size > torch.cuda.device_count():
            raise ModelLoadError(f"tensor_parallel_size {self.world_size} needs as many GPUs; "
                                 f"{torch.cuda.device_count()} present", param="tensor_parallel_size")
        return self._call(LoadModel(spec))

    def load_adapter(self, slot: int, adapter: HostAdapter) -> None:
        """Copy an adapter (laid out for the full model) into `slot` on every rank, each its
        shard."""
        self._call(LoadAdapter(slot, adapter))

    def execute(self, plan: StepPlan, return_logits: bool = False) -> StepOutput:
        """Run one step on every rank; rank 0's tokens (and logits, when asked)."""
        self.launch(plan, return_logits)
        return self.collect()

    def launch(self, plan: StepPlan, return_logits: bool = False) -> None:
        """Queue a step on every rank and return at once: the driver may plan and launch the
        next before it collects this one (the ranks run their commands in order)."""
        self._guarded(self._send, RunStep(plan, return_logits))
        self._num_launched += 1

    def collect(self) -> StepOutput:
        """The oldest launched step's output (waits for it)."""
        if not self._num_launched:
            raise RuntimeError("no step launched")
        self._num_launched -= 1
        return self._guarded(self._replies)[0]

    def _call(self, command: Any) -> list[Any]:
        """Send `command` to every rank; their answers in rank order."""
        if self._num_launched:
            raise RuntimeError(f"collect the {self._num_launched} launched steps first")
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
        return WorkerError(f"worker rank {rank} died (exit code {process.exitcode})")

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
        self._conns, self._processes, self._num_launched = [], [], 0
        shutil.rmtree(self._store_dir, ignore_errors=True)
