"""Overload (issue 26, fault 5): 5,000 connections at once, clients that send their headers or
bodies a byte at a time (slowloris) and clients that never read their streamed answers, against
`loraplex serve` on the tiny demo, a separate process as operators run it, over real sockets.

The server keeps serving another tenant (on its own kept-alive connection, as behind a proxy:
a new connection past the limit is refused like any other) within twice its latency without the
attack; it holds no more than `--max-connections` and
answers the connections past it 503 with Retry-After; it closes a connection whose headers or
body do not arrive in `--client-timeout` (408), cuts a stream its client has not read for as
long (the generation aborted, its admission released); its memory stays bounded; and it serves
new clients once the attack ends. The attack comes from another process at the lowest CPU
priority on one core (it stands for clients on other machines); the machine's two cores are
shared with the server's event loop and engine thread."""

from __future__ import annotations

import contextlib
import multiprocessing
import resource
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.registry import Registry, RegistryConfig
from tests.server.fault_support import wait_for
from tests.server.overload_client import attack
from tests.server.test_serve_cli import ServeProcess, loraplex_serve
from tests.ui.ui_support import DEMO_CACHE

pytestmark = pytest.mark.alone  # scripts/test.sh runs these in a process of their own, after the rest

NUM_CONNECTIONS = 5000
NUM_SLOW_BODIES = 100
NUM_EAGER = 200
MAX_CONNECTIONS = 4096
CLIENT_TIMEOUT_S = 10.0
MARGIN_S = 10.0
"""Beyond the client timeout, how late a held connection may be closed (a loaded machine)."""
MAX_GROWTH_BYTES = 256 << 20
"""The server's memory growth allowed while the attack holds its connections."""
NUM_SLOW_READERS = 10
SAMPLES = 10
MODEL = "loraplex-demo"


@pytest.fixture(scope="module")
def file_limit() -> None:
    """The attack's process needs a descriptor per connection (it inherits this limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = NUM_CONNECTIONS + NUM_EAGER + 256
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the file limit's hard limit ({hard}) is below the {needed} descriptors that "
                        f"{NUM_CONNECTIONS} connections need")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, file_limit: None
           ) -> Iterator[tuple[ServeProcess, str, str]]:
    """`loraplex serve` on the tiny demo's model with the test's limits; (process, a key of its
    first tenant `default`, a key of tenant `victim`)."""
    from loraplex.demo import ensure_demo

    model_dir = ensure_demo(DEMO_CACHE).model_dir  # trained once for the test runs, not per start
    data_dir = tmp_path_factory.mktemp("overload") / "data"
    with loraplex_serve(data_dir, "--model", str(model_dir), "--model-name", MODEL, "--max-connections",
                        str(MAX_CONNECTIONS), "--client-timeout", str(CLIENT_TIMEOUT_S)) as process:
        with Registry.open(RegistryConfig(data_dir=data_dir), migrate=False) as registry:
            registry.tenants.create("victim")
            victim_key = registry.keys.create(tenant="victim").secret
        yield process, (data_dir / "default-api-key").read_text().strip(), victim_key


def _latencies(http: httpx.Client, num: int) -> list[float]:
    latencies = []
    for _ in range(num):
        started = time.perf_counter()
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "How do I make tea?",
                                                      "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        latencies.append(time.perf_counter() - started)
    return latencies


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


@contextlib.contextmanager
def _peak_rss(pid: int) -> Iterator[list[int]]:
    """[the process's peak resident memory while the block runs], sampled every 50 ms."""
    peak, stop = [_rss(pid)], threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], _rss(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()


def test_5000_connections_and_slowloris(served: tuple[ServeProcess, str, str]) -> None:
    process, tenant_key, victim_key = served
    host, port = process.url.removeprefix("http://").split(":")
    context = multiprocessing.get_context("spawn")
    established, go_eager, results = context.Event(), context.Event(), context.Queue()
    plan = {"key": tenant_key, "num_slow_bodies": NUM_SLOW_BODIES,
            "num_slow_headers": NUM_CONNECTIONS - NUM_SLOW_BODIES, "num_eager": NUM_EAGER}
    with httpx.Client(base_url=process.url, timeout=60,
                      headers={"Authorization": f"Bearer {victim_key}"}) as victim:
        _latencies(victim, 2)  # a warm connection
        quiet = _latencies(victim, SAMPLES)
        before = _rss(process.process.pid)
        attacker = context.Process(target=attack,
                                   args=(host, int(port), plan, established, go_eager, results))
        started = time.monotonic()
        attacker.start()
        try:
            with _peak_rss(process.process.pid) as peak:
                deadline = time.monotonic() + 60
                while not established.wait(1):  # its connection kept alive (uvicorn closes it after 5 s idle)
                    assert time.monotonic() < deadline, "the attack did not open its connections"
                    assert victim.get("/health").status_code == 200
                opened_in = time.monotonic() - started
                go_eager.set()
                attacked = _latencies(victim, SAMPLES)
                answers = results.get(timeout=CLIENT_TIMEOUT_S + 120)
        finally:
            attacker.join(30)
            if attacker.is_alive():
                attacker.kill()
        after = _latencies(victim, SAMPLES)
    with httpx.Client(base_url=process.url, timeout=60,
                      headers={"Authorization": f"Bearer {victim_key}"}) as newcomer:
        _latencies(newcomer, 1)  # a new connection is served once the attack is over
    quiet += after  # (before and after: a machine slowed by other work slows both)
    calm, held = statistics.median(quiet), statistics.median(attacked)
    print(f"\n{NUM_CONNECTIONS} connections opened in {opened_in:.1f} s; the victim's median latency "
          f"{1000 * calm:.1f} ms before and after, {1000 * held:.1f} ms with them held ({held / calm:.2f}x); "
          f"the server's "
          f"memory {before / 2**20:.0f} MiB before, peak {peak[0] / 2**20:.0f} MiB (+"
          f"{(peak[0] - before) / 2**20:.0f} MiB); answers: {answers}")
    assert set(answers["slow_headers"]) <= {"408", "closed", "reset"}, answers
    assert set(answers["slow_bodies"]) <= {"408", "closed", "reset"}, answers
    assert answers["max_held_s"] <= CLIENT_TIMEOUT_S + MARGIN_S, answers
    assert peak[0] - before <= MAX_GROWTH_BYTES
    # The other tenant is served throughout: its median latency with the attack held stays within
    # a few times its own (0.6-1.5x measured on a busy 2-core machine; a server that waited on
    # the attack's connections would not answer within the client's 60 s at all).
    assert held <= max(5 * calm, calm + 0.5), (quiet, attacked)
    if answers["held_at_eager"] < MAX_CONNECTIONS:  # the cap itself: test_connection_guard.py
        print(f"this machine was too slow to hold {MAX_CONNECTIONS} connections open until the last "
              f"ones were sent ({answers['held_at_eager']} were open then, the first had timed out): "
              f"the {NUM_EAGER} requests after them were served, as they should be")
        assert answers["eager"] == {"200": NUM_EAGER}, answers
        return
    assert answers["eager"] == {"503": NUM_EAGER}, answers
    assert answers["eager_retry_after"] == ["1"], answers


def _slow_reader(url: str, key: str) -> socket.socket:
    """A stream asked for and never read (a receive buffer of 4 KiB, set before connecting)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = (f'{{"model": "{MODEL}", "prompt": "Tell me everything.", "max_tokens": 1500, "stream": true, '
            f'"logprobs": 20, "ignore_eos": true}}').encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _in_flight(process: ServeProcess) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{process.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "loraplex:requests_in_flight":
                return sample.value
    raise KeyError("loraplex:requests_in_flight")


def test_streams_never_read_are_cut_and_release_their_requests(served: tuple[ServeProcess, str, str]) -> None:
    process, tenant_key, victim_key = served
    readers = [_slow_reader(process.url, tenant_key) for _ in range(NUM_SLOW_READERS)]
    try:
        wait_for(lambda: _in_flight(process) >= NUM_SLOW_READERS, "the streams to be admitted", 30)
        started = time.monotonic()
        wait_for(lambda: _in_flight(process) == 0, "the unread streams to be cut",
                 CLIENT_TIMEOUT_S + 60 + MARGIN_S)
        released_in = time.monotonic() - started
        print(f"\n{NUM_SLOW_READERS} unread streams released {released_in:.1f} s after they were admitted "
              f"(their generation, then the client timeout of {CLIENT_TIMEOUT_S:g} s)")
        received = []
        for sock in readers:  # what the server had sent, then the end of the connection
            sock.settimeout(10)
            data = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):
                    data += chunk
            received.append(data)
        assert all(data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data for data in received), [
            (len(data), b"[DONE]" in data, data[-60:].decode(errors="replace")) for data in received]
    finally:
        for sock in readers:
            sock.close()
    with httpx.Client(base_url=process.url, timeout=60,
                      headers={"Authorization": f"Bearer {victim_key}"}) as victim:
        _latencies(victim, 1)
