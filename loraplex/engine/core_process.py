"""The engine-core process (`loraplex serve --engine-process`): the LLMEngine and its step loop
in a process of their own, so that the server's event loop and the engine's steps do not share
one GIL (vLLM V1's API-server and engine-core processes).

The process is spawned by loraplex.engine.core_client.EngineCoreClient. It builds the engine,
answers Ready (or CallFailed with the reason), then runs AsyncEngine's loop over a pipe: a
reader thread takes the server's commands and wakes the loop; the loop runs them between steps
and sends each step's outputs as one message. It exits on Shutdown, when the server's end of
the pipe closes (the server process died), or when its parent is gone. SIGINT and SIGTERM are
ignored: a Ctrl-C or a SIGTERM sent to the whole process group reaches the server, which drains
and then stops the core."""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from loraplex.engine.core_commands import (
    Abort,
    AdapterLoaded,
    AddRequest,
    Call,
    Shutdown,
    UseAdapterLoader,
)
from loraplex.engine.core_replies import (
    AdapterWanted,
    CallDone,
    CallFailed,
    CoreDied,
    EngineFacts,
    Ready,
    StepOutputs,
)
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import EngineConfig
from loraplex.heap import freeze_startup_heap
from loraplex.types import RequestOutput

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5
"""How long an idle loop sleeps before it looks at its parent again (a command wakes it)."""
ADAPTER_LOAD_TIMEOUT_S = 600.0
"""How long the engine's adapter loader waits for the server to send an adapter."""


def run_engine_core(config: EngineConfig, conn: Connection, parent_pid: int,
                    build: Callable[[EngineConfig], LLMEngine] | None = None) -> None:
    """The process's entry point; `build` makes the engine instead of LLMEngine(config) (a
    benchmark's engine on a model with random weights: loraplex.benchmarks.synthetic_server)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _configure_logging()
    try:
        engine = (build or LLMEngine)(config)
    except BaseException as exc:  # noqa: BLE001 - the server re-raises it
        conn.send(CallFailed(None, portable(exc), traceback.format_exc()))
        return
    try:
        core = EngineCore(engine, conn, parent_pid)
        freeze_startup_heap()
        conn.send(Ready(facts_of(engine)))
        core.run()
    finally:
        engine.close()


def facts_of(engine: LLMEngine) -> EngineFacts:
    return EngineFacts(engine.config, engine.model_config, engine.device, engine.dtype, engine.max_model_len,
                       engine.streaming_window, engine.memory, engine.graphs, frozenset(engine.eos_token_ids),
                       os.getpid())


class EngineCore:
    """The engine's step loop, driven over `conn`."""

    def __init__(self, engine: LLMEngine, conn: Connection, parent_pid: int) -> None:
        self.engine, self._conn, self._parent_pid = engine, conn, parent_pid
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._send_lock = threading.Lock()  # the loop and the adapter loader both send
        self._stopping = False
        self._loads: dict[int, Future] = {}
        self._next_load = 0
        self._loads_lock = threading.Lock()
        self._sent: dict[str, _Sent] = {}
        """What the server has of each unfinished request."""
        self._grammar_threads = ThreadPoolExecutor(1, thread_name_prefix="loraplex-core-grammars")
        self._compiling: set[str] = set()
        """Requests set aside while their constraint compiles."""
        self._aborted_while_compiling: set[str] = set()
        self._reader = threading.Thread(target=self._read, name="loraplex-core-reader", daemon=True)

    def run(self) -> None:
        self._reader.start()
        engine = self.engine
        try:
            while not self._stopping:
                self._run_commands()
                if self._stopping:
                    break
                if engine.has_unfinished_requests():
                    self._send_outputs(engine.step())
                else:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    if os.getppid() != self._parent_pid:  # the server died without closing the pipe
                        return
        except BaseException:  # noqa: BLE001 - anything that kills the loop kills the core
            logger.exception("the engine-core loop died")
            self._send(CoreDied(traceback.format_exc()))
            sys.exit(1)
        finally:
            self._grammar_threads.shutdown(wait=False, cancel_futures=True)
            self._fail_loads(RuntimeError("the engine core is stopping"))
            try:
                if stopped := engine.abort_all():
                    logger.info("aborted %d requests left in the engine", stopped)
            except Exception:  # noqa: BLE001 - an engine that failed may fail again here
                pass

    # Commands -----------------------------------------------------------------------------
    def _read(self) -> None:
        """The reader thread: adapter answers go straight to the loader waiting for them;
        everything else to the loop, in order."""
        while True:
            try:
                command = self._conn.recv()
            except (EOFError, OSError):  # the server's process is gone
                command = Shutdown()
            except Exception:  # noqa: BLE001 - a message that does not unpickle here: a bug
                logger.exception("a command from the server could not be read; stopping")
                command = Shutdown()
            if isinstance(command, AdapterLoaded):
                with self._loads_lock:
                    future = self._loads.pop(command.load_id, None)
                if future is not None and future.set_running_or_notify_cancel():
                    if command.error is not None:
                        future.set_exception(command.error)
                    else:
                        future.set_result(command)
                continue
            self._commands.put(command)
            self._wake.set()
            if isinstance(command, Shutdown):
                return

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Shutdown):
                self._stopping = True
                return
            if isinstance(command, Abort):
                self.engine.abort(command.request_id)
                self._sent.pop(command.request_id, None)
                if command.request_id in self._compiling:
                    self._aborted_while_compiling.add(command.request_id)
                continue
            if isinstance(command, UseAdapterLoader):
                self.engine.set_adapter_loader(self._load_adapter)
                continue
            try:
                if isinstance(command, AddRequest) and self._compile_aside(command):
                    continue
                value = self._run(command)
            except Exception as exc:  # noqa: BLE001 - the caller's error
                self._send(CallFailed(command.call_id, portable(exc), traceback.format_exc()))
            else:
                self._send(CallDone(command.call_id, value))

    def _compile_aside(self, command: AddRequest) -> bool:
        """A request whose constraint is not compiled here yet waits for it on a side thread
        (compiling takes milliseconds to seconds: never on the step loop); it comes back to the
        queue when compiled, or when its compile failed. True if it was set aside."""
        if command.grammar is None or self.engine.grammars.cached(command.grammar) is not None:
            return False
        self._compiling.add(command.request_id)
        compiled = self._grammar_threads.submit(self.engine.grammars.compile, command.grammar)

        def back(_: Future) -> None:
            self._commands.put(_Compiled(command, compiled))
            self._wake.set()

        compiled.add_done_callback(back)
        return True

    def _run(self, command: Call | AddRequest | _Compiled) -> Any:
        engine = self.engine
        if isinstance(command, Call):
            return pickle.loads(command.fn)(engine)
        if isinstance(command, _Compiled):
            request_id, compiled, command = command.command.request_id, command.grammar, command.command
            self._compiling.discard(request_id)
            if request_id in self._aborted_while_compiling:
                self._aborted_while_compiling.discard(request_id)
                return None
            grammar = compiled.result()  # (raises the compile's error)
        else:
            grammar = None if command.grammar is None else engine.grammars.compile(command.grammar)
        engine.add_request(command.request_id, params=command.params, adapter=command.adapter,
                           prompt_token_ids=command.prompt_token_ids, tenant=command.tenant,
                           sample_of=command.sample_of, grammar=grammar, documents=command.documents)
        self._sent[command.request_id] = _Sent()
        return None

    # Outputs ------------------------------------------------------------------------------
    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        """One message a step. The prompt goes once (the server keeps it); the tokens, the text
        and the log-probs as what the step added where they extend what was sent (the text only
        grows but where a stop string is cut off at the end), and the prompt's log-probs with
        the first output only (they are complete from it on and never change)."""
        if not outputs:
            return
        is_delta = []
        for output in outputs:
            sent = self._sent.get(output.request_id)
            logprobs = output.logprobs or ()
            delta = (sent is not None
                     and len(output.token_ids) == sent.num_tokens + len(output.new_token_ids)
                     and len(logprobs) >= sent.num_logprobs and output.text.startswith(sent.text))
            is_delta.append(delta)
            if output.finished:
                self._sent.pop(output.request_id, None)
            elif sent is not None:
                self._sent[output.request_id] = _Sent(len(output.token_ids), output.text, len(logprobs), True)
            output.prompt_token_ids = []  # a fresh object every step: the engine keeps none
            if delta:
                output.token_ids = []
                output.text = output.text[len(sent.text):]
                if output.logprobs is not None:
                    output.logprobs = output.logprobs[sent.num_logprobs:]
                if sent.has_output:
                    output.prompt_logprobs = None
        self._send(StepOutputs(outputs, is_delta))

    def _send(self, message: Any) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the server is gone; the reader stops the loop
                self._commands.put(Shutdown())
                self._wake.set()

    # Adapters -----------------------------------------------------------------------------
    def _load_adapter(self, digest: str) -> Any:
        """The engine's adapter loader (on the adapter cache's worker thread): ask the server
        where the adapter is, wait for the answer, and read it here."""
        future: Future = Future()
        with self._loads_lock:
            self._next_load += 1
            load_id = self._next_load
            self._loads[load_id] = future
        self._send(AdapterWanted(load_id, digest))
        try:
            answer: AdapterLoaded = future.result(ADAPTER_LOAD_TIMEOUT_S)
        finally:
            with self._loads_lock:
                self._loads.pop(load_id, None)
        return answer.read()  # (read here: the adapter never crosses the pipe)

    def _fail_loads(self, exc: BaseException) -> None:
        with self._loads_lock:
            loads, self._loads = self._loads, {}
        for future in loads.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)


@dataclass(frozen=True)
class _Sent:
    """What the server has of a request's outputs: its tokens, text and log-probs so far, and
    whether it has had an output (with the prompt's log-probs)."""

    num_tokens: int = 0
    text: str = ""
    num_logprobs: int = 0
    has_output: bool = False


@dataclass(frozen=True)
class _Compiled:
    """A request set aside for its constraint, back in the queue once it compiled (or failed)."""

    command: AddRequest
    grammar: Future

    @property
    def call_id(self) -> int:
        return self.command.call_id


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling whole (type, message, code and param), else a
    RuntimeError with its type and message."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to round-trip
        copy = None
    if copy is not None and type(copy) is type(exc) and copy.__dict__ == exc.__dict__:
        return exc
    return RuntimeError(f"{type(exc).__name__}: {exc}")


def _configure_logging() -> None:
    root = logging.getLogger("loraplex")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s (engine core): "
                                               "%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
