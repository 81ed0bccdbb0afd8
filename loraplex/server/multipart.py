"""A multipart/form-data body read as it arrives (python-multipart's push parser), so that a
large file part can be streamed onward instead of being buffered whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from loraplex.registry.registry_errors import InvalidInputError

MAX_PARTS = 8


@dataclass(frozen=True)
class PartStart:
    name: str
    filename: str | None


@dataclass(frozen=True)
class PartData:
    data: bytes


@dataclass(frozen=True)
class PartEnd:
    pass


Event = PartStart | PartData | PartEnd


async def read_multipart(request: Request) -> AsyncIterator[Event]:
    """The body's parts as events: PartStart, PartData..., PartEnd for each part, in order.
    Raises InvalidInputError for a body that is not well-formed multipart/form-data."""
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise InvalidInputError("send the adapter as multipart/form-data")
    events: list[Event] = []
    headers: dict[bytes, bytes] = {}
    header = [b"", b""]
    num_parts = 0

    def on_header_end() -> None:
        headers[header[0].lower()] = header[1]
        header[0] = header[1] = b""

    def on_headers_finished() -> None:
        nonlocal num_parts
        num_parts += 1
        if num_parts > MAX_PARTS:
            raise InvalidInputError(f"the form has more than {MAX_PARTS} parts")
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        if b"name" not in disposition:
            raise InvalidInputError("a form part has no name")
        filename = disposition.get(b"filename")
        events.append(PartStart(_text(disposition[b"name"]), None if filename is None else _text(filename)))
        headers.clear()

    callbacks: dict[str, Any] = {
        "on_header_field": lambda data, start, end: header.__setitem__(0, header[0] + data[start:end]),
        "on_header_value": lambda data, start, end: header.__setitem__(1, header[1] + data[start:end]),
        "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
        "on_part_data": lambda data, start, end: events.append(PartData(bytes(data[start:end]))),
        "on_part_end": lambda: events.append(PartEnd()),
    }
    parser = MultipartParser(boundary, callbacks)
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            for event in events:
                yield event
            events.clear()
        parser.finalize()
    except FormParserError as exc:
        raise InvalidInputError(f"the multipart body is malformed ({exc})") from None
    for event in events:
        yield event


def _text(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError("a form part's name is not UTF-8") from None
