"""The regression pass's serving stage: scripts/gpu-serving.sh's first run, smaller. The
synthetic server (Llama-3-8B shape, 1,000 rank-16 adapters over 40 tenants, 32 device slots)
runs the saturation workload through the engine directly, then serves it; `loraplex bench
serve` sends the same requests over HTTP; SIGTERM drains the server; serve_report sums up
HTTP against offline (serve-summary.json's `http_vs_offline`). Needs the server's packages."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.benchmarks import serve_report

SERVER_PACKAGES = ("fastapi", "uvicorn", "sqlalchemy", "httpx")


@dataclass(frozen=True)
class ServingSizes:
    server: tuple[str, ...]
    """synthetic_server's options besides port, setup, offline and out."""
    workload: tuple[tuple[str, Any], ...]
    """WorkloadConfig fields, the same for the offline pass and the HTTP run (all at once)."""
    drain_s: float = 20.0
    """How long the server may take to drain after SIGTERM."""

    def argv(self) -> list[str]:
        """What the stage runs with, as the pass records it (a record is used only by a pass that
        ran the same)."""
        return [*self.server, *(f"{key}={value}" for key, value in self.workload)]

    def bench_options(self) -> list[str]:
        names = {"num_prompts", "num_tenants", "num_adapters", "prompt_len", "prompt_dist",
                 "max_prompt_len", "output_len", "zipf_alpha", "seed"}
        options = []
        for key, value in self.workload:
            if key in names:
                options += [f"--{key.replace('_', '-')}", str(value)]
        return options


def missing_packages() -> list[str]:
    return [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]


def run(sizes: ServingSizes, folder: Path, limit_s: float) -> tuple[str, dict[str, Any] | None]:
    """(status, serve-summary) within `limit_s`: "ok", or what went wrong; the server's and the
    client's logs stay in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + limit_s
    port = _free_port()
    setup = folder / "setup.json"
    server_log = (folder / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "loraplex.benchmarks.synthetic_server", "--port", str(port),
         "--setup", str(setup), *sizes.server, "--offline", json.dumps(dict(sizes.workload)),
         "--out", str(folder), "--shutdown-timeout", str(int(sizes.drain_s) // 2)],
        stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        status = _wait_ready(server, port, deadline - sizes.drain_s)
        if status == "ok":
            status = _bench(sizes, folder, setup, deadline - sizes.drain_s - time.monotonic())
    finally:
        drained = _drain(server, sizes.drain_s)
        server_log.close()
    if status == "ok" and not drained:
        status = "the server did not drain (killed)"
    summary = serve_report.summarize(folder)
    (folder / "serve-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return status, summary


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(server: subprocess.Popen, port: int, deadline: float) -> str:
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return f"the server exited ({server.returncode}) before it was ready"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1).close()
            return "ok"
        except OSError:
            time.sleep(1)
    return "the server was not ready in time"


def _bench(sizes: ServingSizes, folder: Path, setup: Path, limit_s: float) -> str:
    if limit_s < 5:
        return "no time left for the HTTP run"
    # --time-limit: requests unfinished by then fail and the JSON is written all the same.
    command = [sys.executable, "-m", "loraplex.benchmarks", "serve", "--setup", str(setup),
               "--tag", "saturation-1000", "--out", str(folder), "--no-plot",
               "--time-limit", f"{max(limit_s - 10, 1):.0f}", *sizes.bench_options()]
    with (folder / "serve-saturation-1000.log").open("w") as log:
        try:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return f"the HTTP run outlasted {limit_s:.0f} s"
    saturated = folder / "serve-saturation-1000.json"
    if done.returncode or not saturated.is_file():
        return f"the HTTP run failed (exit {done.returncode})"
    failed = json.loads(saturated.read_text()).get("failed")
    return f"{failed} requests failed over HTTP" if failed else "ok"


def _drain(server: subprocess.Popen, drain_s: float) -> bool:
    """SIGTERM, then SIGKILL to its process group if it is still running after `drain_s`."""
    if server.poll() is not None:
        return server.returncode == 0
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=drain_s) == 0
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        return False
