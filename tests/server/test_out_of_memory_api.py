"""A request whose engine step runs out of memory (issue 26, fault 3) at the API: 503 with
Retry-After and the code `out_of_device_memory`, while streams already running finish; once
memory is back the same request is served. The failure is real: the process's data segment is
capped as in tests/engine/test_out_of_memory.py (the server runs in a thread of this process)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.adapter_format import BaseModelShape
from loraplex.engine.llm_engine import LLMEngine
from loraplex.registry import RegistryConfig
from tests.engine.test_out_of_memory import HEADROOM_BYTES, memory_cap
from tests.server.server_support import MODEL_ID, Server, make_engine, make_model, serve

pytestmark = pytest.mark.alone  # scripts/test.sh runs these in a process of their own, after the rest

WIDE_MLP = BaseModelShape(num_layers=1, hidden_size=128, intermediate_size=4096, num_heads=4,
                          num_kv_heads=2, head_dim=32)
"""Wide where activations are: a 1,000-token prompt step needs about 200 MB, a decode step of a
few requests well under 1 MB."""
BIG_PROMPT = "a" * 1000  # a token a byte
NUM_STREAMS = 3
STREAM_TOKENS = 64


@pytest.fixture(scope="module")
def wide_engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    folder = make_model(tmp_path_factory.mktemp("wide-mlp") / "model", WIDE_MLP, max_positions=2048)
    return make_engine(folder, max_model_len=2048, max_num_batched_tokens=1024, max_num_seqs=8)


@pytest.fixture
def wide_server(tmp_path: Path, wide_engine: LLMEngine) -> Iterator[Server]:
    with serve(RegistryConfig(data_dir=tmp_path / "data"), wide_engine) as server:
        yield server


def _stream(server: Server, started: threading.Event, results: list[str]) -> None:
    with server.http(server.keys["acme"]) as http, http.stream("POST", "/v1/completions", json={
            "model": MODEL_ID, "prompt": "small", "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}) as response:
        lines = []
        for line in response.iter_lines():
            lines.append(line)
            started.set()
        results.append("\n".join(lines))


def _complete(server: Server) -> httpx.Response:
    with server.http(server.keys["acme"]) as http:
        return http.post("/v1/completions", json={"model": MODEL_ID, "prompt": BIG_PROMPT, "max_tokens": 4,
                                                  "ignore_eos": True})


def test_a_request_out_of_memory_gets_503_and_running_streams_finish(wide_server: Server) -> None:
    results: list[str] = []
    events = [threading.Event() for _ in range(NUM_STREAMS)]
    streams = [threading.Thread(target=_stream, args=(wide_server, event, results)) for event in events]
    for thread in streams:
        thread.start()
    for event in events:
        assert event.wait(60), "a stream did not start"
    with memory_cap(HEADROOM_BYTES):
        refused = _complete(wide_server)
    for thread in streams:
        thread.join(60)
    print(f"\nthe big prompt's answer under the cap: {refused.status_code} {refused.json()}")
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "out_of_device_memory"
    assert len(results) == NUM_STREAMS
    assert all(text.rstrip().endswith("data: [DONE]") and '"error"' not in text for text in results)
    assert _complete(wide_server).status_code == 200
