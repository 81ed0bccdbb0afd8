"""The server's side of the engine-core process (`loraplex serve --engine-process`):
EngineCoreClient has AsyncEngine's interface (call, submit, generate, abort, adapters,
shutdown, is_alive, error) over a pipe to a spawned process that holds the LLMEngine
(loraplex.engine.core_process), and EngineView holds the engine's fixed facts that the server
reads (model config, context length, tokenizer, structured-output compiler).

Two threads carry the pipe, so the event loop never waits on it: a writer sends what callers
queue (pickling there, off the event loop), a reader takes the core's messages (a step's
outputs handed to each listening event loop in one wake-up, answers to calls, the adapter
loader's requests). When the core dies, every request in flight and every call waiting ends
with EngineDeadError, as when AsyncEngine's thread dies."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import itertools
import logging
import os
import pickle
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch.multiprocessing as mp

from loraplex.adapter_format import LoraAdapter
from loraplex.engine.async_engine import EngineDeadError, _put_all, _Stream
from loraplex.engine.blending import DocumentBlend
from loraplex.engine.core_commands import (
    Abort,
    AdapterLoaded,
    AddRequest,
    Call,
    Shutdown,
    UseAdapterLoader,
)
from loraplex.engine.core_process import portable, run_engine_core
from loraplex.engine.core_replies import (
    AdapterWanted,
    CallDone,
    CallFailed,
    CoreDied,
    EngineFacts,
    Ready,
    StepOutputs,
)
from loraplex.engine.grammar import CompiledGrammar, GrammarCompiler
from loraplex.engine.streaming import window_problem
from loraplex.engine_config import EngineConfig
from loraplex.model.tokenizer import load_tokenizer
from loraplex.types import RequestOutput, SamplingParams, StreamingWindow, TokenLogprob

logger = logging.getLogger(__name__)
T = TypeVar("T")
AdapterLocator = Callable[[str], Callable[[], Any]]
"""digest -> a function that pickles and reads the adapter where it is called (in the core)."""
CORE_PROCESS_NAME = "loraplex-engine-core"
STOP_GRACE_S = 10.0
"""How long shutdown waits for the core to exit before it is terminated, then killed."""


class EngineCoreClient:
    """An LLMEngine in a spawned process, driven as AsyncEngine drives one on a thread. Build
    with `start`; `view` stands in for the engine where the server reads its fixed facts."""

    def __init__(self, process: Any, conn: Any, facts: EngineFacts, tokenizer: Any) -> None:
        self.facts = facts
        self.view = EngineView(facts, tokenizer, self)
        self.error: BaseException | None = None
        self._process, self._conn = process, conn
        self._lock = threading.Lock()  # calls and listeners, against the reader's death
        self._calls: dict[int, Future] = {}
        self._listeners: dict[str, _Listener] = {}
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._adapter_locator: AdapterLocator | None = None
        self._is_stopping = False
        self._writer = threading.Thread(target=self._write, name="loraplex-core-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="loraplex-core-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        atexit.register(self.shutdown)  # a non-daemon child would otherwise hold the exit

    @classmethod
    def start(cls, config: EngineConfig, build: Callable[[EngineConfig], Any] | None = None,
              tokenizer: Any = None) -> EngineCoreClient:
        """Spawn the core and wait until it has built the engine (weights, memory plan, CUDA
        graphs); an engine that cannot be built raises its error here (ModelLoadError, ...).
        `build` (it must pickle) makes the engine in the core instead of LLMEngine(config), and
        `tokenizer` is then the server's (else loaded from config.model)."""
        # Spawned, never forked (CUDA); not a daemon, so that it may spawn tensor-parallel workers.
        context = mp.get_context("spawn")
        conn, child = context.Pipe()
        process = context.Process(target=run_engine_core, name=CORE_PROCESS_NAME,
                                  args=(config, child, os.getpid(), build))
        process.start()
        child.close()  # the child's end lives in the child only: its death closes the pipe
        tokenizer_error = None
        try:  # while the core builds the engine
            tokenizer = tokenizer or load_tokenizer(config.model)
        except Exception as exc:  # noqa: BLE001 - raised below, unless the core says why first
            tokenizer_error = exc
        try:
            message = conn.recv()
        except (EOFError, OSError):
            process.join(5)
            conn.close()
            raise EngineDeadError(f"the engine-core process exited while building the engine (exit code "
                                  f"{process.exitcode})") from None
        if isinstance(message, CallFailed):
            process.join(10)
            conn.close()
            raise message.error
        assert isinstance(message, Ready), message
        client = cls(process, conn, message.facts, tokenizer)
        if tokenizer_error is not None:
            client.shutdown()
            raise tokenizer_error
        logger.info("engine core running in process %d", message.facts.pid)
        return client

    @property
    def pid(self) -> int:
        return self.facts.pid

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._process.is_alive()

    # Commands -----------------------------------------------------------------------------
    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` in the core between two steps and return its result (or raise its
        error). `fn` must pickle: a module-level function, a partial of one, a methodcaller."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[Any], T]) -> Future:
        data = pickle.dumps(fn)
        return self._ask(lambda call_id: Call(call_id, data))

    async def add_adapter(self, name: str, source: str | Path | LoraAdapter) -> str:
        return await self.call(functools.partial(_add_adapter, name=name, source=source))

    async def remove_adapter(self, name: str) -> None:
        await self.call(functools.partial(_remove_adapter, name=name))

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def set_adapter_locator(self, locate: AdapterLocator) -> None:
        """Answer the core's requests for adapters by digest with where to read each
        (`locate(digest)`, run here: a function that pickles, which the core calls on its own
        loader thread). No adapter's tensors cross the pipe, where requests would queue behind
        them (84 MB for a rank-16 Llama-3-8B adapter)."""
        self._adapter_locator = locate
        self._outbox.put(UseAdapterLoader())

    def _ask(self, make: Callable[[int], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError("the engine has stopped") from self.error
            call_id = next(self._ids)
            self._calls[call_id] = future
        self._outbox.put(make(call_id))
        return future

    def _abort(self, request_id: str) -> None:
        with self._lock:
            self._listeners.pop(request_id, None)
        if self.error is None:
            self._outbox.put(Abort(request_id))

    # Requests -----------------------------------------------------------------------------
    async def generate(
        self, request_id: str, *, prompt_token_ids: list[int], params: SamplingParams,
        adapter: str | None = None, tenant: str | None = None, sample_of: str | None = None,
        grammar: CompiledGrammar | None = None, documents: DocumentBlend | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: outputs until the request finishes; invalid requests raise
        before the first; leaving early aborts it; outputs that pile up come merged."""
        listener = _Listener(asyncio.get_running_loop(), _Stream(), list(prompt_token_ids))
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError("the engine has stopped") from self.error
            self._listeners[request_id] = listener
        add = functools.partial(AddRequest, request_id=request_id, prompt_token_ids=listener.prompt_token_ids,
                                params=params, adapter=adapter, tenant=tenant, sample_of=sample_of,
                                grammar=None if grammar is None else grammar.spec, documents=documents)
        try:
            await asyncio.wrap_future(self._ask(add))
        except BaseException:
            self._abort(request_id)  # (harmless where the core never added it)
            raise
        finished = False
        try:
            while True:
                output = await listener.stream.next_output()
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            if not finished:
                self._abort(request_id)

    # The pipe -----------------------------------------------------------------------------
    def _write(self) -> None:
        """The writer thread: send what is queued, in order (None: stop)."""
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the core is gone: the reader says so
                return
            except Exception as exc:  # noqa: BLE001 - a message that does not pickle
                call_id = getattr(message, "call_id", None)
                with self._lock:
                    future = self._calls.pop(call_id, None)
                if future is not None and future.set_running_or_notify_cancel():
                    future.set_exception(exc)
                else:
                    logger.exception("could not send %s to the engine core", type(message).__name__)

    def _read(self) -> None:
        """The reader thread: the core's messages, until its end of the pipe closes."""
        cause: BaseException | None = None
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, StepOutputs):
                    self._deliver(message)
                elif isinstance(message, CallDone | CallFailed):
                    with self._lock:
                        future = self._calls.pop(message.call_id, None)
                    if future is not None and future.set_running_or_notify_cancel():
                        if isinstance(message, CallDone):
                            future.set_result(message.value)
                        else:
                            future.set_exception(message.error)
                elif isinstance(message, AdapterWanted):
                    self._send_adapter(message)
                elif isinstance(message, CoreDied):
                    cause = RuntimeError(f"the engine-core loop failed:\n{message.traceback}")
        except (EOFError, OSError):  # the core exited (or was killed)
            pass
        except Exception as exc:  # noqa: BLE001 - a message that does not unpickle: the core is unusable
            logger.exception("could not read the engine core's message")
            cause = exc
        self._died(cause)

    def _deliver(self, message: StepOutputs) -> None:
        """A step's outputs to their streams: one wake-up of each listening event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for output, is_delta in zip(message.outputs, message.is_delta, strict=True):
                listener = self._listeners.get(output.request_id)
                if listener is None:  # aborted here since
                    continue
                if output.finished:
                    del self._listeners[output.request_id]
                output.prompt_token_ids = listener.prompt_token_ids
                if is_delta:  # (the core's _send_outputs)
                    output.token_ids = listener.token_ids + output.new_token_ids
                    output.text = listener.text + output.text
                    if output.logprobs is not None:
                        output.logprobs = listener.logprobs + output.logprobs
                    if output.prompt_logprobs is None:
                        output.prompt_logprobs = listener.prompt_logprobs
                listener.token_ids, listener.text = output.token_ids, output.text
                listener.logprobs, listener.prompt_logprobs = output.logprobs or [], output.prompt_logprobs
                batches.setdefault(listener.loop, []).append((listener.stream, output))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's event loop is gone: nobody listens
                for _, output in batch:
                    self._abort(output.request_id)

    def _send_adapter(self, wanted: AdapterWanted) -> None:
        """On the reader thread (a lookup: the core reads the adapter): where the adapter that
        the core asks for is, or why it cannot be found."""
        try:
            if self._adapter_locator is None:
                raise RuntimeError("no adapter locator is set")
            reply = AdapterLoaded(wanted.load_id, read=self._adapter_locator(wanted.digest))
        except Exception as exc:  # noqa: BLE001 - the requests that need it fail with it
            reply = AdapterLoaded(wanted.load_id, error=portable(exc))
        self._outbox.put(reply)

    def _died(self, cause: BaseException | None) -> None:
        self._process.join(1)
        if self._is_stopping and cause is None:
            error: BaseException = EngineDeadError("the engine was shut down")
        else:
            error = EngineDeadError(f"the engine-core process {self.pid} stopped (exit code "
                                    f"{self._process.exitcode})")
            error.__cause__ = cause
            logger.error("%s%s", error, f": {cause}" if cause is not None else "")
        with self._lock:
            self.error = error
            calls, self._calls = self._calls, {}
            listeners, self._listeners = self._listeners, {}
        for listener in listeners.values():
            with contextlib.suppress(RuntimeError):  # that caller's loop is closed
                listener.loop.call_soon_threadsafe(listener.stream.put, error)
        for future in calls.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine has stopped"))
        self._outbox.put(None)

    def shutdown(self, timeout: float = STOP_GRACE_S) -> None:
        """Stop the core (requests in flight end with EngineDeadError): Shutdown; after
        `timeout`, terminate; then kill. Idempotent."""
        if self._is_stopping:
            return
        self._is_stopping = True
        atexit.unregister(self.shutdown)
        self._outbox.put(Shutdown())
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine core did not stop in %.0f s: terminating it", timeout)
            self._process.kill()
            self._process.join(5)
        self._reader.join(5)
        self._writer.join(5)
        self._conn.close()


@dataclass
class _Listener:
    """A request's stream, and what the core sends only once (its prompt, and its tokens, text
    and log-probs so far, and the prompt's log-probs)."""

    loop: asyncio.AbstractEventLoop
    stream: _Stream
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _add_adapter(engine: Any, name: str, source: Any) -> str:
    return engine.add_adapter(name, source)


def _remove_adapter(engine: Any, name: str) -> None:
    engine.remove_adapter(name)


class EngineView:
    """The engine's fixed facts where the server reads them from an LLMEngine: sent by the core
    when it is built; the tokenizer and the structured-output compiler are this process's own,
    made from the same model folder."""

    def __init__(self, facts: EngineFacts, tokenizer: Any, client: EngineCoreClient) -> None:
        self.config, self.model_config = facts.config, facts.model_config
        self.device, self.dtype = facts.device, facts.dtype
        self.max_model_len, self.streaming_window = facts.max_model_len, facts.streaming_window
        self.memory, self.graphs = facts.memory, facts.graphs
        self.eos_token_ids = facts.eos_token_ids
        self.tokenizer = tokenizer
        self._client = client
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """As LLMEngine.grammars (compiled here, off the event loop; the core compiles each
        constraint again from its spec)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler.for_model(self.tokenizer, self.model_config.vocab_size,
                                                           self.eos_token_ids)
            return self._grammars

    def window_problem(self, window: StreamingWindow) -> str | None:
        return window_problem(window, self.config.cache.block_size, self.max_model_len)

