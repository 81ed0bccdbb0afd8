"""The CLI as operators and outside checks run it: a separate process (`python -m
loraplex.cli` and the `loraplex` console script), options from the environment, the key alone
on stdout, one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.registry import RegistryConfig
from tests.registry.registry_support import write_adapter

KEY = re.compile(r"lpx-[A-Za-z0-9_-]{43}\n")
CONSOLE_SCRIPT = Path(sys.executable).with_name("loraplex")


def _run(config: RegistryConfig, *args: str, command: list[str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"LORAPLEX_DATA_DIR": str(config.data_dir),
                        "LORAPLEX_DATABASE_URL": config.url}
    env.pop("LORAPLEX_DEBUG", None)
    return subprocess.run([*(command or [sys.executable, "-m", "loraplex.cli"]), *args],
                          env=env, capture_output=True, text=True, timeout=60)


def _assert_one_line_error(result: subprocess.CompletedProcess[str], code: int,
                           reason: str) -> None:
    assert result.returncode == code and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert reason in result.stderr, result.stderr


def test_operator_session(registry_config: RegistryConfig, tmp_path: Path) -> None:
    assert _run(registry_config, "db", "upgrade").returncode == 0
    assert _run(registry_config, "tenant", "create", "acme").returncode == 0
    key = _run(registry_config, "key", "create", "--tenant", "acme")
    assert key.returncode == 0 and key.stderr == ""
    assert KEY.fullmatch(key.stdout), repr(key.stdout)  # the key, a newline, nothing else
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 128, "num_key_value_heads": 2, "vocab_size": 300}))
    adapter = write_adapter(tmp_path / "adapter")
    upload = _run(registry_config, "adapter", "upload", "--tenant", "acme", "--name", "sql",
                  str(adapter), "--model", str(model))
    assert upload.returncode == 0, upload.stderr
    listing = _run(registry_config, "adapter", "list")
    assert [line.split()[:2] for line in listing.stdout.splitlines()[1:]] == [["acme", "sql"]]
    _assert_one_line_error(_run(registry_config, "tenant", "create", "acme"), 1,
                           "loraplex: error: tenant 'acme' already exists")
    _assert_one_line_error(
        _run(registry_config, "adapter", "upload", "--tenant", "acme", "--name", "../x",
             str(adapter), "--model", str(model)), 1, "invalid adapter name '../x'")
    _assert_one_line_error(_run(registry_config, "key", "create"), 2,
                           "one of the arguments --tenant --admin is required")


def test_console_script(registry_config: RegistryConfig) -> None:
    if not CONSOLE_SCRIPT.is_file():
        pytest.skip("the package is not installed with its console script")
    key = _run(registry_config, "key", "create", "--admin", command=[str(CONSOLE_SCRIPT)])
    assert key.returncode == 0 and KEY.fullmatch(key.stdout) and key.stderr == ""
    _assert_one_line_error(_run(registry_config, "key", "revoke", "7",
                                command=[str(CONSOLE_SCRIPT)]), 1, "API key 7 does not exist")


def test_serve_refuses_a_model_folder_it_cannot_serve(registry_config: RegistryConfig,
                                                      tmp_path: Path) -> None:
    result = _run(registry_config, "serve", "--model", str(tmp_path / "missing"), "--port", "9",
                  "--device", "cpu")
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]  # serve logs its start-up steps first
    assert last.startswith("loraplex: error: ") and "has no config.json" in last, result.stderr
