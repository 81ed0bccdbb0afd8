"""The engine on its own thread, fed through asyncio: what the server drives.

Every engine call runs on the engine thread, so the engine stays single-threaded. Callers
submit commands (add a request, abort, add or remove an adapter) and await their results;
each request's outputs arrive on its own asyncio queue. A caller that stops listening (a
client that disconnects) aborts its request, which frees its KV blocks at once.

One engine thread drives an engine at a time: a new AsyncEngine waits for the previous one's
thread to end, and a thread that ends leaves the engine idle (its requests aborted: nobody is
left to hear their outputs), so an engine handed on to a new server starts clean."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from loraplex.adapter_format import LoraAdapter
from loraplex.engine.blending import DocumentBlend
from loraplex.engine.grammar import CompiledGrammar
from loraplex.engine.llm_engine import LLMEngine
from loraplex.types import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
HANDOVER_TIMEOUT_S = 30.0
ENGINE_THREAD_NAME = "loraplex-engine"
_drivers: weakref.WeakKeyDictionary[LLMEngine, threading.Thread] = weakref.WeakKeyDictionary()
"""The thread that drives each engine."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Stream]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        previous = _drivers.get(engine)
        if previous is not None:
            previous.join(HANDOVER_TIMEOUT_S)
            if previous.is_alive():
                raise RuntimeError("another engine thread still drives this engine")
        self._thread = threading.Thread(target=self._loop, name=ENGINE_THREAD_NAME, daemon=True)
        _drivers[engine] = self._thread
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # Commands -----------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread and return its result (or raise its error)."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future:
        if not self.is_alive:
            raise EngineDeadError("the engine has stopped") from self.error
        future: Future = Future()
        self._commands.put((lambda: fn(self.engine), future))
        self._wake.set()
        return future

    async def add_adapter(self, name: str, source: str | Path | LoraAdapter) -> str:
        return await self.call(lambda e: e.add_adapter(name, source))

    async def remove_adapter(self, name: str) -> None:
        await self.call(lambda e: e.remove_adapter(name))

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: self._abort(e, request_id))

    def _abort(self, engine: LLMEngine, request_id: str) -> None:
        engine.abort(request_id)
        self._streams.pop(request_id, None)

    # Requests -----------------------------------------------------------------------------
    async def generate(
        self, request_id: str, *, prompt_token_ids: list[int], params: SamplingParams,
        adapter: str | None = None, tenant: str | None = None, sample_of: str | None = None,
        grammar: CompiledGrammar | None = None, documents: DocumentBlend | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes. Invalid requests raise before the
        first output. Leaving the loop early (or being cancelled) aborts the request. Outputs
        that pile up while the caller is busy come merged into one (the latest, with the new
        tokens and text of all), so a caller that falls behind catches up in one step."""
        stream = _Stream()
        loop = asyncio.get_running_loop()

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, params=params, adapter=adapter, prompt_token_ids=prompt_token_ids,
                               tenant=tenant, sample_of=sample_of, grammar=grammar, documents=documents)
            self._streams[request_id] = (loop, stream)

        await self.call(add)
        finished = False
        try:
            while True:
                output = await stream.next_output()
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            if not finished and self.is_alive:
                self.submit(lambda e: self._abort(e, request_id))

    # The engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - anything that kills the loop kills the engine
            logger.exception("the engine thread died")
            self.error = exc
        else:
            self.error = EngineDeadError("the engine was shut down")
        # Whoever still waits on a stream or a command hears that the engine is gone.
        for loop, stream in self._streams.values():
            with contextlib.suppress(RuntimeError):  # RuntimeError: that caller's loop is closed
                loop.call_soon_threadsafe(stream.put, self.error)
        self._streams.clear()
        self._fail_pending(self.error)
        with contextlib.suppress(Exception):  # an engine that failed may fail again here
            if stopped := self.engine.abort_all():
                logger.info("aborted %d requests left in the engine", stopped)

    def _run_commands(self) -> None:
        while True:
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(command())
            except Exception as exc:
                future.set_exception(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each listening event loop per
        step (a call_soon_threadsafe writes to the loop's self-pipe), not one per output."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for output in outputs:
            target = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
            if target is not None:
                batches.setdefault(target[0], []).append((target[1], output))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's event loop is gone: nobody listens
                for _, output in batch:
                    self._abort(self.engine, output.request_id)

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine has stopped"))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests in flight end with EngineDeadError)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)


def merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`later` (cumulative fields are the latest) with what both added."""
    return replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids,
                   new_text=earlier.new_text + later.new_text)


class _Stream:
    """One request's outputs (or the engine's death), put by the engine thread through the
    caller's event loop and taken there, all that has arrived at once."""

    def __init__(self) -> None:
        self._items: list[RequestOutput | BaseException] = []
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    async def take(self) -> list[RequestOutput | BaseException]:
        await self._ready.wait()
        self._ready.clear()
        items, self._items = self._items, []
        return items

    async def next_output(self) -> RequestOutput:
        """What has arrived, merged into one output (EngineDeadError if the engine died)."""
        items = await self.take()
        for item in items:
            if isinstance(item, BaseException):
                raise EngineDeadError("the engine stopped while serving the request") from item
        return functools.reduce(merged, items)


def _put_all(batch: list[tuple[_Stream, RequestOutput]]) -> None:
    """On the event loop: each output onto its stream."""
    for stream, output in batch:
        stream.put(output)
