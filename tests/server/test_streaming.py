"""The SSE chunks of a streamed answer: ChunkEvents writes, with its fixed fields encoded once
and the usage counts written directly, the same text as the JSON encoder makes of the whole
chunk."""

from __future__ import annotations

import json

import pytest

from loraplex.server.streaming import ChunkEvents, sse

FIXED = {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "a0001",
         "system_fingerprint": "loraplex-0"}
CHOICE = {"index": 0, "text": ' "é\n\u2028', "finish_reason": None, "logprobs": None}


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7},
    {"prompt_tokens": 12, "completion_tokens": 345, "total_tokens": 357}, None])
def test_a_chunk_with_usage_reads_as_the_encoder_writes_it(usage: dict[str, int] | None) -> None:
    event = ChunkEvents(FIXED).event([CHOICE], usage)
    assert event == sse({**FIXED, "choices": [CHOICE], "usage": usage})
    assert json.loads(event.removeprefix("data: "))["usage"] == usage


def test_a_chunk_without_usage_has_no_usage_field() -> None:
    event = ChunkEvents(FIXED).event([CHOICE])
    assert event == sse({**FIXED, "choices": [CHOICE]})
    assert "usage" not in json.loads(event.removeprefix("data: "))
