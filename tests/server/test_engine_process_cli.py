"""`loraplex serve --engine-process` as operators run it: the engine runs in a child process of
the server's; SIGTERM drains (a stream in flight runs to its end) and stops the child cleanly.
(That the core stops when its server dies is test_engine_process_core's: the pipe closes.)"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.server.server_support import MODEL_ID, make_model
from tests.server.test_serve_cli import loraplex_serve

STOP_S = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("engine-process-cli") / "model")


def _engine_children(pid: int) -> list[int]:
    """The spawned engine-core processes whose parent is `pid` (not multiprocessing's resource
    tracker)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # exited meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and "spawn_main" in cmdline:
            children.append(int(entry.name))
    return children


def _is_gone(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _is_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _serve(tmp_path: Path, model: Path):
    return loraplex_serve(tmp_path / "data", "--model", str(model), "--model-name", MODEL_ID,
                          "--enforce-eager", "--dtype", "float32", "--engine-process")


def test_sigterm_drains_and_stops_the_engine_process(tmp_path: Path, model: Path) -> None:
    with _serve(tmp_path, model) as served:
        (core,) = _engine_children(served.process.pid)
        key = (tmp_path / "data" / "default-api-key").read_text().strip()
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
        answer = client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4
        chunks: list[str] = []
        stream = client.completions.create(model=MODEL_ID, prompt="Drained", max_tokens=32, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        reader = threading.Thread(target=lambda: chunks.extend(
            c.choices[0].finish_reason or "" for c in stream if c.choices))
        reader.start()
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(STOP_S) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
        reader.join(10)
        assert first.choices and chunks[-1] == "length"  # the stream in flight ran to its end
        assert _wait_gone(core, 5), "the engine process outlived the server"
        output = served.output()
        assert "Traceback" not in output and "did not stop" not in output
        assert "engine core running in process" in output


def test_the_engine_process_is_the_default_on_a_gpu_and_the_flags_override_it(monkeypatch) -> None:
    import torch

    from loraplex.cli import build_parser
    from loraplex.cli.serve import use_engine_process

    assert use_engine_process(None, "cuda") and not use_engine_process(None, "cpu")
    assert use_engine_process(True, "cpu") and not use_engine_process(False, "cuda")
    for present in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda present=present: present)
        assert use_engine_process(None, "auto") is present
    parse = build_parser().parse_args
    assert parse(["serve"]).engine_process is None
    assert parse(["serve", "--engine-process"]).engine_process is True
    assert parse(["serve", "--no-engine-process"]).engine_process is False
