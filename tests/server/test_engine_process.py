"""The engine in a process of its own (EngineCoreClient, `loraplex serve --engine-process`)
behind a real uvicorn server, through the official `openai` client: it answers as the server
with an engine thread does (same greedy tokens: completions, chat, streams, logprobs, a JSON
constraint, a registered system prompt, an adapter uploaded while serving), a client that
leaves stops its engine work, and a core that dies fails requests with 503 instead of hanging.
The last test kills the core: the module's server is not used after it."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loraplex.engine.core_client import EngineCoreClient
from loraplex.engine.llm_engine import LLMEngine
from loraplex.registry import RegistryConfig
from loraplex.registry.registry_errors import RegistryError
from tests.server.conftest import add_adapters
from tests.server.server_support import MODEL_ID, Server, engine_config, replace_config, serve, upload_files

GREEDY = {"temperature": 0, "max_tokens": 8}
LONG = 480
"""max_tokens that keeps a request busy for seconds (the context is 512)."""
PROMPT_TEXT = "You answer in one short line."


@pytest.fixture(scope="module")
def core(model_dir: Path) -> Iterator[EngineCoreClient]:
    client = EngineCoreClient.start(engine_config(model_dir))
    try:
        yield client
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def core_server(core: EngineCoreClient, adapter_dirs: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("engine-process") / "data"
    with serve(RegistryConfig(data_dir=data_dir), core, tenants=("acme", "globex")) as running:
        add_adapters(running, adapter_dirs)
        yield running


@pytest.fixture(scope="module")
def thread_server(engine: LLMEngine, adapter_dirs: dict[str, Path],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("engine-thread") / "data"
    with serve(RegistryConfig(data_dir=data_dir), engine, tenants=("acme", "globex")) as running:
        add_adapters(running, adapter_dirs)
        yield running


def _answers(server: Server, late_adapter: Path) -> dict[str, Any]:
    client = server.openai("acme")
    answers: dict[str, Any] = {}
    for model in (MODEL_ID, "style", "shared"):
        answers[f"{model} completion"] = client.completions.create(
            model=model, prompt="Hello there", **GREEDY).choices[0].text
        answers[f"{model} chat"] = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi!"}], **GREEDY).choices[0].message.content
    stream = client.completions.create(model="style", prompt="Streamed", stream=True, **GREEDY)
    answers["stream"] = [chunk.choices[0].text for chunk in stream if chunk.choices]
    scored = client.completions.create(model="shared", prompt="Scores", logprobs=2, **GREEDY).choices[0]
    answers["logprobs"] = (scored.logprobs.tokens, [round(v, 4) for v in scored.logprobs.token_logprobs])
    answers["two samples"] = sorted(c.text for c in client.completions.create(
        model=MODEL_ID, prompt="Twice", n=2, seed=3, max_tokens=6).choices)
    answers["json"] = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=12).choices[0].message.content
    server.registry.prompts.add("acme", "desk", PROMPT_TEXT, adapter="style")
    answers["system prompt"] = client.chat.completions.create(
        model="style", messages=[{"role": "user", "content": "Hi!"}], extra_body={"system_prompt": "desk"},
        **GREEDY).choices[0].message.content
    with server.http() as http:
        assert http.delete("/admin/api/prompts/acme/desk").status_code == 204  # unpinned in the engine
        response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": "late"},
                             files=upload_files(late_adapter))
        assert response.status_code == 201, response.text
    answers["late adapter"] = client.completions.create(model="late", prompt="Hello there",
                                                        **GREEDY).choices[0].text
    with pytest.raises(openai.NotFoundError):  # an error from the engine keeps its status
        client.completions.create(model="f" * 64, prompt="Hi", **GREEDY)
    return answers


def _engine_state(server: Server) -> dict:
    with server.http() as http:
        return http.get("/admin/api/engine").json()


def _wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_engine_process_answers_as_the_engine_thread_does(
        core_server: Server, thread_server: Server, adapter_dirs: dict[str, Path]) -> None:
    want = _answers(thread_server, adapter_dirs["mlp"])
    got = _answers(core_server, adapter_dirs["mlp"])
    assert got == want
    assert want["style completion"] != want[f"{MODEL_ID} completion"]  # the adapters change outputs


def test_the_engine_runs_in_a_process_of_its_own(core_server: Server, core: EngineCoreClient) -> None:
    assert core.pid != os.getpid() and core.is_alive
    state = _engine_state(core_server)
    assert state["is_alive"] and state["num_requests_running"] == 0
    assert httpx.get(f"{core_server.url}/ready", timeout=10).status_code == 200
    assert core_server.metric("vllm:num_requests_running") == 0
    # The engine's CPU is the core process's: its build alone took more than the server's loop.
    engine_cpu = core_server.metric("loraplex:thread_cpu_seconds_total", thread="engine")
    assert engine_cpu > core_server.metric("loraplex:thread_cpu_seconds_total", thread="event_loop")


def test_a_client_that_leaves_a_stream_stops_its_engine_work(core_server: Server) -> None:
    with core_server.http(core_server.keys["acme"]) as http, http.stream("POST", "/v1/completions", json={
            "model": "style", "prompt": "go on", "max_tokens": LONG, "ignore_eos": True,
            "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert _engine_state(core_server)["num_requests_running"] == 1
    _wait_until(lambda: _engine_state(core_server)["num_requests_running"] == 0, 5, "the running count drop")
    assert core_server.metric("loraplex:requests_aborted_total") == 1


def test_the_core_reads_adapters_where_the_server_says_and_a_missing_blob_fails_that_request_only(
        core_server: Server, core: EngineCoreClient, adapter_dirs: dict[str, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The server tells the core where an adapter's blobs are (AdapterNames.locate: a call that
    pickles); the core reads them itself, so no tensor crosses the pipe. Blobs gone from the store
    fail the requests for that adapter (a 500: the server's fault; the reason in its log), and the
    others go on."""
    import pickle
    import shutil

    from loraplex.server.adapter_names import AdapterNames

    folder = tmp_path / "alpha"
    shutil.copytree(adapter_dirs["qv"], folder)
    replace_config(folder, lora_alpha=3)  # a digest (and a config blob) of its own
    record = core_server.registry.adapters.upload_dir("globex", "fragile", folder)
    view = core.view
    names = AdapterNames(core_server.registry, view.model_config.shape, view.config.lora.max_lora_rank, 60)
    asyncio.run(names.lookup("globex", "fragile"))
    read = pickle.loads(pickle.dumps(names.locate(record.digest)))
    assert read().digest == names.load(record.digest).digest == record.digest
    with pytest.raises(RegistryError, match="asked for on this server"):
        names.locate("0" * 64)

    record.config_path.unlink()
    client = core_server.openai("globex")
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="fragile", prompt="Hello there", **GREEDY)
    assert "the blobs of adapter globex/fragile are missing from the blob store" in caplog.text
    assert client.completions.create(model="shared", prompt="Hello there", **GREEDY).choices[0].text


def test_a_killed_engine_process_fails_requests_with_503(core_server: Server, core: EngineCoreClient) -> None:
    events: list[str] = []

    def stream() -> None:
        with core_server.http(core_server.keys["acme"]) as http, http.stream(
                "POST", "/v1/completions", json={"model": MODEL_ID, "prompt": "go on", "max_tokens": LONG,
                                                 "ignore_eos": True, "stream": True}) as response:
            events.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    _wait_until(lambda: _engine_state(core_server)["num_requests_running"] == 1, 10, "the stream to start")
    os.kill(core.pid, signal.SIGKILL)
    reader.join(10)
    assert not reader.is_alive(), "the stream hung after the engine process died"
    assert events[-1] == "data: [DONE]" and "engine_unavailable" in events[-2]  # the error event, then [DONE]
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as failed:
        core_server.openai("acme", timeout=10).completions.create(model=MODEL_ID, prompt="Hi", **GREEDY)
    assert failed.value.status_code == 503 and time.monotonic() - started < 5
    assert failed.value.body["code"] == "engine_unavailable"
    ready = httpx.get(f"{core_server.url}/ready", timeout=10)
    assert ready.status_code == 503 and "engine has stopped" in ready.text
    assert not core.is_alive and "exit code -9" in str(core.error)
