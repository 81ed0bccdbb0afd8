"""Adapter uploads through the admin API: a multipart form with `tenant`, `name`,
`adapter_config` (adapter_config.json) and `adapter_model` (adapter_model.safetensors). The
weights are streamed from the socket straight into the registry's upload (hashed and written to
its temporary file as they arrive; nothing large is held in memory), which validates them with
the same code as every other upload and stores nothing unless all checks pass. If the weights
come before the other fields, they are spooled to a temporary file first."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from collections import deque
from typing import IO

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_format import CONFIG_NAME, MAX_CONFIG_BYTES, PICKLE_NAMES, WEIGHTS_NAME
from loraplex.errors import AdapterError
from loraplex.registry import Registry
from loraplex.registry.names import check_name
from loraplex.registry.records import AdapterRecord
from loraplex.registry.registry_errors import InvalidInputError
from loraplex.server.multipart import PartData, PartEnd, PartStart, read_multipart

FIELDS = ("tenant", "name")
CONFIG_FIELD, WEIGHTS_FIELD = "adapter_config", "adapter_model"
MAX_FIELD_BYTES = 256
MAX_BUFFERED_BYTES = 8 << 20
SPOOL_BYTES = 1 << 20


class UploadAborted(Exception):
    """The request ended before the weights did (client gone, body too large, malformed)."""


class ByteChannel:
    """Bytes from the event loop to a reader thread (`read` is the file-like end the registry
    reads), with back-pressure: `send` waits while `max_buffered` bytes are unread."""

    def __init__(self, max_buffered: int = MAX_BUFFERED_BYTES) -> None:
        self._loop = asyncio.get_running_loop()
        self._condition = threading.Condition()
        self._chunks: deque[bytes] = deque()
        self._num_buffered = 0
        self._max_buffered = max_buffered
        self._is_finished = False
        self._error: BaseException | None = None
        self._is_reader_gone = False
        self._space = asyncio.Event()

    async def send(self, data: bytes) -> bool:
        """Queue bytes; False if the reader has stopped (the upload failed: stop sending)."""
        while True:
            with self._condition:
                if self._is_reader_gone:
                    return False
                if self._num_buffered < self._max_buffered:
                    self._chunks.append(data)
                    self._num_buffered += len(data)
                    self._condition.notify()
                    return True
                self._space.clear()
            await self._space.wait()

    def finish(self) -> None:
        with self._condition:
            self._is_finished = True
            self._condition.notify()

    def fail(self, error: BaseException) -> None:
        with self._condition:
            if not self._is_finished:
                self._error = error
            self._condition.notify()

    # The reader's end (a worker thread) ----------------------------------------------------
    def read(self, size: int = -1) -> bytes:
        with self._condition:
            while not self._chunks and not self._is_finished and self._error is None:
                self._condition.wait()
            if self._error is not None:
                raise UploadAborted("the upload did not complete") from self._error
            if not self._chunks:
                return b""
            chunk = self._chunks.popleft()
            if 0 < size < len(chunk):
                chunk, rest = chunk[:size], chunk[size:]
                self._chunks.appendleft(rest)
            self._num_buffered -= len(chunk)
        self._loop.call_soon_threadsafe(self._space.set)
        return chunk

    def close_reader(self) -> None:
        with self._condition:
            self._is_reader_gone = True
        self._loop.call_soon_threadsafe(self._space.set)


async def receive_adapter(request: Request, registry: Registry, actor: int) -> AdapterRecord:
    """Read the upload form and store the adapter; typed errors (400/404/409/413) otherwise."""
    with contextlib.ExitStack() as files:
        return await _receive(request, registry, actor, files)


async def _receive(request: Request, registry: Registry, actor: int,
                   files: contextlib.ExitStack) -> AdapterRecord:
    fields: dict[str, str] = {}
    config: bytes | None = None
    current: PartStart | None = None
    buffer = bytearray()
    channel: ByteChannel | None = None
    upload: asyncio.Future[AdapterRecord] | None = None
    spool: IO[bytes] | None = None
    try:
        async for event in read_multipart(request):
            if isinstance(event, PartStart):
                current = _check_part(event, fields, config, channel or spool)
                buffer.clear()
                if current.name == WEIGHTS_FIELD:
                    if all(f in fields for f in FIELDS) and config is not None:
                        channel = ByteChannel()
                        upload = asyncio.ensure_future(run_in_threadpool(
                            _upload, registry, fields, config, channel, actor))
                    else:
                        spool = files.enter_context(
                            tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES))  # noqa: SIM115
            elif isinstance(event, PartData) and current is not None:
                if current.name != WEIGHTS_FIELD:
                    buffer.extend(event.data)
                    _check_size(current.name, len(buffer))
                elif channel is not None:
                    await channel.send(event.data)
                elif spool is not None:
                    await run_in_threadpool(spool.write, event.data)
            elif isinstance(event, PartEnd) and current is not None:
                if current.name == CONFIG_FIELD:
                    config = bytes(buffer)
                elif current.name in FIELDS:
                    fields[current.name] = _field_name(current.name, buffer)
                elif channel is not None:
                    channel.finish()
                current = None
        if current is not None:
            raise InvalidInputError("the multipart body ended inside a part")
        if upload is not None:
            return await upload
        missing = [f for f in (*FIELDS, CONFIG_FIELD, WEIGHTS_FIELD)
                   if f not in fields and not (f == CONFIG_FIELD and config is not None)
                   and not (f == WEIGHTS_FIELD and spool is not None)]
        if missing:
            raise InvalidInputError(f"the upload form lacks {', '.join(missing)}", param=missing[0])
        assert spool is not None and config is not None  # no field is missing
        await run_in_threadpool(spool.seek, 0)
        return await run_in_threadpool(registry.adapters.upload, fields["tenant"], fields["name"],
                                       config, spool, actor=actor)
    except BaseException as exc:
        if channel is not None:
            channel.fail(exc)
        if upload is not None:
            await asyncio.wait({upload})  # the registry has removed its temporary files
            if not upload.cancelled():
                upload.exception()  # retrieved: `exc` is the error to report
        raise


def _upload(registry: Registry, fields: dict[str, str], config: bytes, channel: ByteChannel,
            actor: int) -> AdapterRecord:
    try:
        return registry.adapters.upload(fields["tenant"], fields["name"], config, channel, actor=actor)
    finally:
        channel.close_reader()


def _check_part(part: PartStart, fields: dict[str, str], config: bytes | None,
                weights: object) -> PartStart:
    if part.name not in (*FIELDS, CONFIG_FIELD, WEIGHTS_FIELD):
        raise InvalidInputError(f"unexpected form field {part.name!r}: send tenant, name, "
                                f"{CONFIG_FIELD} ({CONFIG_NAME}) and {WEIGHTS_FIELD} ({WEIGHTS_NAME})",
                                param=part.name[:64])
    if part.name in fields or (part.name == CONFIG_FIELD and config is not None) or (
            part.name == WEIGHTS_FIELD and weights is not None):
        raise InvalidInputError(f"the form field {part.name!r} is given twice", param=part.name)
    if part.name == WEIGHTS_FIELD and part.filename and part.filename.endswith(
            tuple(name.rsplit(".", 1)[1] for name in PICKLE_NAMES)):
        raise AdapterError(f"{part.filename} is a pickle file, which loraplex never loads: upload "
                           f"{WEIGHTS_NAME}")
    return part


def _check_size(name: str, size: int) -> None:
    if name == CONFIG_FIELD and size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes")
    if name in FIELDS and size > MAX_FIELD_BYTES:
        raise InvalidInputError(f"the form field {name!r} is longer than {MAX_FIELD_BYTES} bytes",
                                param=name)


def _field_name(field: str, value: bytearray) -> str:
    """A tenant or adapter name from the form, checked before it reaches the database."""
    try:
        return check_name(value.decode("utf-8"), "adapter" if field == "name" else field)
    except UnicodeDecodeError:
        raise InvalidInputError(f"the form field {field!r} is not UTF-8 text", param=field) from None
    except InvalidInputError as exc:
        raise InvalidInputError(exc.message, param=field) from None
