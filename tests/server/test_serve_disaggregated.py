"""`loraplex serve --disaggregate 1:1` as operators run it (CPU: the engine-core process and two
gloo worker processes, one a side): it answers through the official client as a server with one
colocated engine does (test_engine_process's answers: greedy completions and chat from the base
model and adapters, a stream, log-probs, two samples of one prompt, a JSON constraint, a
registered system prompt, an adapter uploaded while it serves); /metrics shows the KV
sent between the sides and each side's queue; the admin engine API shows both sides. And the
flags' refusals, before anything loads."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.cli import build_parser, main
from loraplex.cli.disaggregate import checked_disaggregation, placed
from loraplex.cli.engine_flags import engine_config
from loraplex.engine.llm_engine import LLMEngine
from loraplex.errors import LoraplexError
from loraplex.registry import Registry, RegistryConfig
from tests.registry.registry_support import MAX_RANK
from tests.server.conftest import add_adapters
from tests.server.server_support import MODEL_ID, Server, serve
from tests.server.test_engine_process import _answers
from tests.server.test_serve_cli import ServeProcess, loraplex_serve

GREEDY = {"temperature": 0, "max_tokens": 8}
ENGINE_FLAGS = ("--enforce-eager", "--dtype", "float32", "--block-size", "16", "--num-kv-blocks", "1024",
                "--max-num-seqs", "64", "--max-lora-rank", str(MAX_RANK), "--max-loras", "4",
                "--max-model-len", "512")
"""The server tests' engine settings (tests/server/server_support.engine_config)."""


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    data_dir = tmp_path_factory.mktemp("serve-disaggregated") / "data"
    with loraplex_serve(data_dir, "--model", str(model_dir), "--model-name", MODEL_ID, *ENGINE_FLAGS,
                        "--disaggregate", "1:1") as running:
        yield running


@pytest.fixture(scope="module")
def disaggregated(served: ServeProcess, adapter_dirs: dict[str, Path]) -> Iterator[Server]:
    """The disaggregated server with the server tests' tenants and adapters (tests/server/conftest),
    written into its registry from here."""
    with Registry.open(RegistryConfig(data_dir=served.log.parent / "data"), migrate=False) as registry:
        keys = {}
        for tenant in ("acme", "globex"):
            registry.tenants.create(tenant)
            keys[tenant] = registry.keys.create(tenant=tenant).secret
        running = Server(served.url, registry, registry.keys.create(admin=True).secret, keys)
        add_adapters(running, adapter_dirs)
        yield running


@pytest.fixture(scope="module")
def colocated(engine: LLMEngine, adapter_dirs: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("serve-colocated") / "data"
    with serve(RegistryConfig(data_dir=data_dir), engine, tenants=("acme", "globex")) as running:
        add_adapters(running, adapter_dirs)
        yield running


def _engine_state(server: Server) -> dict[str, Any]:
    with server.http() as http:
        response = http.get("/admin/api/engine")
    assert response.status_code == 200, response.text
    return response.json()


def test_a_disaggregated_server_answers_as_a_colocated_one(
        served: ServeProcess, disaggregated: Server, colocated: Server,
        adapter_dirs: dict[str, Path]) -> None:
    want = _answers(colocated, adapter_dirs["mlp"])
    got = _answers(disaggregated, adapter_dirs["mlp"])
    assert got == want
    assert want["style completion"] != want[f"{MODEL_ID} completion"]  # the adapters change outputs
    output = served.output()
    assert "Traceback" not in output and "engine core running in process" in output


def test_metrics_and_the_admin_api_show_both_sides_and_the_transfers(disaggregated: Server,
                                                                     colocated: Server) -> None:
    client = disaggregated.openai("acme")
    assert client.completions.create(model=MODEL_ID, prompt="A prompt of some blocks " * 4,
                                     **GREEDY).usage.completion_tokens == GREEDY["max_tokens"]
    assert disaggregated.metric("loraplex:kv_transfer_bytes_total") > 0
    assert disaggregated.metric("loraplex:kv_transfer_blocks_total") > 0
    assert disaggregated.metric("loraplex:kv_transfer_seconds_count") >= 1
    for side in ("prefill", "decode"):
        assert disaggregated.metric("loraplex:side_kv_blocks_total", side=side) > 0
        assert disaggregated.metric("loraplex:side_requests_waiting", side=side) >= 0
    with pytest.raises(KeyError):  # a colocated engine has no sides
        colocated.metric("loraplex:kv_transfer_bytes_total")

    deadline = time.monotonic() + 10
    while True:  # the last request's blocks go back on both sides once it has ended there
        state = _engine_state(disaggregated)
        sides = state["sides"]
        if all(side["kv_blocks_used"] == 0 for side in sides.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert set(sides) == {"prefill", "decode"}
    for side in sides.values():
        assert side["kv_blocks_used"] == 0 and side["num_requests_running"] == 0
        assert side["kv_blocks_total"] > 0
    assert state["kv_blocks_total"] == sum(side["kv_blocks_total"] for side in sides.values())
    transfers = state["kv_transfers"]
    assert transfers["num_transfers"] >= 1 and transfers["num_bytes"] > 0 and transfers["num_blocks"] >= 1
    assert transfers["bytes_per_second"] > 0
    assert _engine_state(colocated)["sides"] is None


# The flags, checked before anything loads -------------------------------------------------
def _checked(*argv: str) -> str | None:
    args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
    return checked_disaggregation(args, engine_config(".", args))


@pytest.mark.parametrize(("argv", "message"), [
    (("--disaggregate", "2:1"), "--disaggregate 2:1: only 1:1"),
    (("--disaggregate", "1:2"), "--disaggregate 1:2: only 1:1"),
    (("--disaggregate", "one"), "--disaggregate 'one': give P:D"),
    (("--disaggregate", "0:1"), "--disaggregate '0:1': give P:D"),
    (("--disaggregate", "1:1:1"), "--disaggregate '1:1:1': give P:D"),
    (("--disaggregate", "1:1", "--tensor-parallel-size", "2"), "--tensor-parallel-size 2"),
    (("--disaggregate", "1:1", "--no-engine-process"), "--no-engine-process"),
    (("--disaggregate", "auto", "--no-engine-process"), "--no-engine-process"),
    (("--slo-ttft", "1"), "--slo-ttft is the target that --disaggregate auto"),
    (("--disaggregate", "1:1", "--slo-tpot", "0.05"), "--slo-tpot is the target"),
    (("--disaggregate", "auto", "--slo-tpot", "0"), "--slo-tpot 0: a target is a positive"),
])
def test_bad_disaggregate_flags_are_refused(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(LoraplexError, match=message.replace("(", r"\(")):
        _checked(*argv)


def test_good_disaggregate_flags_pass() -> None:
    assert _checked() is None
    assert _checked("--disaggregate", "1:1") == "1:1"
    assert _checked("--disaggregate", "1:1", "--engine-process") == "1:1"
    assert _checked("--disaggregate", "auto", "--slo-ttft", "2", "--slo-tpot", "0.02") == "auto"


def test_on_cuda_two_gpus_are_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device in ("cuda", "auto"):
        args = build_parser().parse_args(["serve", "--device", device, "--disaggregate", "1:1"])
        with pytest.raises(LoraplexError, match="needs two GPUs, one a side; this machine has 1"):
            checked_disaggregation(args, engine_config(".", args))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = build_parser().parse_args(["serve", "--device", "cuda", "--disaggregate", "1:1"])
    assert checked_disaggregation(args, engine_config(".", args)) == "1:1"


def test_a_bad_flag_stops_serve_before_anything_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr("loraplex.cli.serve._configure_logging", lambda: None)  # (no handler left behind)
    argv = ["serve", "--device", "cpu", "--model", str(tmp_path / "absent"), "--disaggregate", "2:1"]
    assert main(argv) == 1
    assert "loraplex: error: --disaggregate 2:1: only 1:1" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_auto_places_for_the_targets_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="loraplex")
    parse = build_parser().parse_args
    # Issue 23's workload at TPOT 50 ms: colocated serves more (docs/disaggregated.md's table).
    assert placed("auto", parse(["serve", "--disaggregate", "auto"])) is None
    assert "chose colocated: serving one colocated engine" in caplog.text
    assert "colocated serves" in caplog.text and "others: 1:1" in caplog.text  # each candidate's goodput
    caplog.clear()
    # At TPOT 20 ms prompt chunks in colocated steps break the target: 1:1.
    assert placed("auto", parse(["serve", "--disaggregate", "auto", "--slo-tpot", "0.02"])) == "1:1"
    assert "1:1 serves" in caplog.text and "others: colocated" in caplog.text
    assert "chose 1:1" in caplog.text
    assert placed("1:1", argparse.Namespace()) == "1:1"
