"""Load test: many concurrent streaming clients against `loraplex serve` on the tiny demo.

    loraplex bench load [--clients 200] [--limited-clients 40] [--requests 3] [--max-tokens 32]

Starts `loraplex serve --demo tiny` (CPU; built once into --data-dir) unless --url is given, then
runs, all at once: `--clients` streaming chat clients of tenant `demo` (no limits) spread over
the base model and the three demo adapters, and `--limited-clients` more of a tenant limited to
--limit concurrent requests, which must see 429s past its limit and nothing else. Each client
makes --requests requests in a row over plain asyncio connections (see stream_chat; the openai
client lists the models), without retries. Any error other than those 429s fails the run.
Writes bench/results/load.json: requests per second, time to first token p50/p99, output tokens
per second, the 429 count, and how much the client's own event loop lagged (on a small machine
the client shares the CPU with the server; a lagging client inflates the latencies it sees)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from loraplex.benchmarks.results import RESULTS

RESULTS_FILE = RESULTS / "load.json"
DEMO_TENANT = "demo"
LIMITED_TENANT = "bench-limited"
CONTENT = re.compile(rb'"delta":\{"content":"[^"]')
"""A chunk that carries generated text (the first chunk holds only the role and "")."""
QUESTIONS = ("How do I make a cup of tea?", "What is the capital of France?", "Tell me about the sea.",
             "How far away is the moon?", "Why is the sky blue?")


@dataclass
class Stats:
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    completed: int = 0
    rate_limited: int = 0
    errors: list[str] = field(default_factory=list)
    client_lag_s: list[float] = field(default_factory=list)


async def client(url: str, key: str, models: list[str], index: int, args: argparse.Namespace,
                 stats: Stats, *, is_limited: bool) -> None:
    """One user: `args.requests` streaming chats in a row."""
    for turn in range(args.requests):
        model = models[(index + turn) % len(models)]
        body = {"model": model, "stream": True, "max_tokens": args.max_tokens, "temperature": 0.7,
                "ignore_eos": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": QUESTIONS[(index * 7 + turn) % len(QUESTIONS)]}]}
        started = time.perf_counter()
        try:
            status, first, events = await stream_chat(url, key, body)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            stats.errors.append(f"{model}: {type(exc).__name__}: {exc}")
            continue
        if status == 429:
            if not is_limited:
                stats.errors.append(f"429 for the unlimited tenant ({model})")
            stats.rate_limited += 1
            await asyncio.sleep(0.05)
            continue
        usage = next((json.loads(e[6:])["usage"] for e in events
                      if e.startswith(b'data: {"') and b'"usage":{' in e), None)
        if status != 200 or usage is None or first is None or any(b'"error":' in e for e in events):
            stats.errors.append(f"{model}: HTTP {status} {b' '.join(events)[:200]!r}")
            continue
        stats.ttft_s.append(first - started)
        stats.e2e_s.append(time.perf_counter() - started)
        stats.completion_tokens += usage["completion_tokens"]
        stats.completed += 1


async def stream_chat(url: str, key: str, body: dict) -> tuple[int, float | None, list[bytes]]:
    """POST /v1/chat/completions over a plain asyncio connection (HTTP/1.1, chunked response),
    scanning the stream for the first generated text: (status, when that text came, the last
    events). A general-purpose client (httpx, openai) parses every chunk in Python, and 200 of
    them on the server's two cores make the client, not the server, what is measured."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                     % (host.encode(), key.encode(), len(payload)) + payload)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:  # an error body (JSON), then the server closes the connection
            return status, None, [await reader.read()]
        first, tail = None, b""
        while True:  # chunked transfer encoding: a hex size line, the data, CRLF
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            data = (await reader.readexactly(size + 2))[:-2]
            if first is None and CONTENT.search(data):
                first = time.perf_counter()
            tail = (tail + data)[-4096:]
        return status, first, tail.split(b"\n\n")
    finally:
        writer.close()


async def run_load(url: str, demo_key: str, limited_key: str | None, args: argparse.Namespace) -> dict:
    demo = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=demo_key, max_retries=0)
    models = [m.id async for m in demo.models.list()]
    await demo.close()
    stats = Stats()
    lag = asyncio.ensure_future(measure_lag(stats))
    tasks = [client(url, demo_key, models, i, args, stats, is_limited=False) for i in range(args.clients)]
    if limited_key is not None:
        tasks += [client(url, limited_key, models[:1], i, args, stats, is_limited=True)
                  for i in range(args.limited_clients)]
    started = time.perf_counter()
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    lag.cancel()
    return report(stats, duration, models, args)


async def measure_lag(stats: Stats, interval_s: float = 0.05) -> None:
    while True:
        started = time.perf_counter()
        await asyncio.sleep(interval_s)
        stats.client_lag_s.append(time.perf_counter() - started - interval_s)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def report(stats: Stats, duration: float, models: list[str], args: argparse.Namespace) -> dict:
    return {
        "clients": args.clients, "limited_clients": args.limited_clients,
        "limited_tenant_max_concurrent_requests": args.limit if args.limited_clients else None,
        "requests_per_client": args.requests, "max_tokens": args.max_tokens, "models": models,
        "completed": stats.completed, "rate_limited_429": stats.rate_limited, "errors": len(stats.errors),
        "duration_s": round(duration, 2),
        "requests_per_s": round(stats.completed / duration, 2),
        "output_tokens_per_s": round(stats.completion_tokens / duration, 1),
        "ttft_p50_ms": round(percentile(stats.ttft_s, 50) * 1000, 1),
        "ttft_p99_ms": round(percentile(stats.ttft_s, 99) * 1000, 1),
        "ttft_mean_ms": round(statistics.fmean(stats.ttft_s) * 1000, 1) if stats.ttft_s else None,
        "e2e_p50_ms": round(percentile(stats.e2e_s, 50) * 1000, 1),
        "e2e_p99_ms": round(percentile(stats.e2e_s, 99) * 1000, 1),
        "client_loop_lag_p50_ms": round(percentile(stats.client_lag_s, 50) * 1000, 1),
        "client_loop_lag_p99_ms": round(percentile(stats.client_lag_s, 99) * 1000, 1),
        "error_samples": stats.errors[:5],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "load_average_1min_before": args.load_before,
        "device": "cpu",
    }


# The server ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_demo(data_dir: Path, log_path: Path) -> Iterator[str]:
    port = free_port()
    env = os.environ | {"LORAPLEX_DATA_DIR": str(data_dir)}
    env.pop("LORAPLEX_DATABASE_URL", None)
    with open(log_path, "wb") as log:
        command = [sys.executable, "-m", "loraplex.cli", "serve", "--demo", "tiny", "--device", "cpu",
                   "--port", str(port)]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # the first start builds the demo
        while True:
            if process.poll() is not None:
                raise SystemExit(f"loraplex serve exited; see {log_path}")
            if time.monotonic() > deadline:
                raise SystemExit(f"loraplex serve did not start; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def limited_tenant_key(url: str, admin_key: str, limit: int) -> str:
    """A key of a tenant limited to `limit` concurrent requests (created or updated)."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as http:
        created = http.post("/admin/api/tenants", json={"name": LIMITED_TENANT,
                                                        "max_concurrent_requests": limit})
        if created.status_code == 409:
            http.patch(f"/admin/api/tenants/{LIMITED_TENANT}", json={"max_concurrent_requests": limit})
        else:
            created.raise_for_status()
        key = http.post("/admin/api/keys", json={"tenant": LIMITED_TENANT})
        key.raise_for_status()
        return key.json()["secret"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--limited-clients", type=int, default=40)
    parser.add_argument("--limit", type=int, default=8, help="the limited tenant's concurrent requests")
    parser.add_argument("--requests", type=int, default=3, help="requests per client, in a row")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/loraplex-bench-data"))
    parser.add_argument("--url", help="an already running server (then give --api-key and "
                        "--admin-key, or the data dir holding their files)")
    parser.add_argument("--api-key")
    parser.add_argument("--admin-key")
    parser.add_argument("--output", type=Path, default=RESULTS_FILE)
    args = parser.parse_args(argv)
    args.load_before = round(os.getloadavg()[0], 2)  # other work on the machine skews the figures

    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(serve_demo(args.data_dir, args.data_dir.parent /
                                                         "loraplex-bench-serve.log"))
        demo_key = args.api_key or (args.data_dir / "demo-api-key").read_text().strip()
        admin_key = args.admin_key or (args.data_dir / "admin-api-key").read_text().strip()
        limited_key = limited_tenant_key(url, admin_key, args.limit) if args.limited_clients else None
        result = asyncio.run(run_load(url, demo_key, limited_key, args))
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}) as http:
            engine = http.get("/admin/api/engine").json()
        result["engine_after"] = {k: engine[k] for k in ("num_requests_running", "num_requests_waiting",
                                                          "num_requests_in_flight", "kv_blocks_used")}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("error_samples", "models")}, indent=2))
    ok = result["errors"] == 0 and (not args.limited_clients or result["rate_limited_429"] > 0)
    print(f"{'OK' if ok else 'FAILED'}: {result['completed']} requests, {result['requests_per_s']} req/s, "
          f"TTFT p50 {result['ttft_p50_ms']} ms / p99 {result['ttft_p99_ms']} ms, "
          f"{result['output_tokens_per_s']} output tokens/s, {result['rate_limited_429']} 429s, "
          f"{result['errors']} errors")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
