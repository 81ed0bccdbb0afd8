"""One tenant floods the server with prompts that cannot fit; another tenant's small request
keeps its normal latency. On the demo model (a trained byte-level BPE tokenizer, 2048-token
context): a real uvicorn server in the test process, the other tenant's client on a thread
beside it (8 tokens, greedy, a request of about 25 ms here), the flood from another process kept
to one core at the lowest CPU priority (it stands for clients on other machines: it shares
neither the server's interpreter lock nor, when the server needs it, its CPU).

The flood: three clients, each sending its next prompt 20 ms after the last was refused:
about 120 prompts of 4 MB a second, 4 Gbit/s of prompt text. (Unpaced, three local clients
reconnect several hundred times a second, and what slows the other tenant then is that traffic
itself: a flood of empty requests at that rate does as much. Bounding connection rates is the
work of the proxy in front of the server.) A second flood sends prompts just small enough to
be tokenized, and refused only then: the tokenizer's fairness is what keeps the other tenant's
latency there.

The bound: the median latency of a 1-token request while the flood runs is at most twice its
median while it does not. The two are measured in alternating phases of the same test (so
that a machine that other work slows down now and then slows both alike), and medians of
several requests each absorb the odd scheduling hiccup of a shared 2-core machine. Twice the
normal latency is what the issue asks; before the fix the other tenant's request took seconds
(about 13 s on this machine: the tokenizer worked through 4 MB prompts ahead of it)."""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.engine.llm_engine import LLMEngine
from loraplex.registry import RegistryConfig
from tests.server.flood_client import flood
from tests.server.server_support import Server, make_engine, serve
from tests.ui.ui_support import DEMO_CACHE

pytestmark = pytest.mark.alone  # scripts/test.sh runs these in a process of their own, after the rest

NUM_FLOODERS = 3
PAUSE_S = 0.02
NUM_PHASES = 4
SAMPLES_PER_PHASE = 10
PROMPT_BYTES = 4_000_000


@pytest.fixture(scope="module")
def demo_engine() -> LLMEngine:
    from loraplex.demo import ensure_demo

    return make_engine(ensure_demo(DEMO_CACHE).model_dir, max_model_len=2048, num_kv_blocks=512)


@pytest.fixture
def demo_server(tmp_path: Path, demo_engine: LLMEngine) -> Iterator[Server]:
    with serve(RegistryConfig(data_dir=tmp_path / "data"), demo_engine, tenants=("flooder", "victim"),
               model_id="loraplex-demo") as server:
        yield server


def _latencies(http: httpx.Client, num: int) -> list[float]:
    latencies = []
    for _ in range(num):
        started = time.perf_counter()
        response = http.post("/v1/completions", json={
            "model": "loraplex-demo", "prompt": "How do I make tea?", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        latencies.append(time.perf_counter() - started)
    return latencies


def _wait(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _latency_with_and_without_flood(server: Server, prompt: str) -> tuple[float, float, dict]:
    """(median latency without the flood, with it, the flood's answers), in alternating
    phases."""
    body = json.dumps({"model": "loraplex-demo", "prompt": prompt, "max_tokens": 1}).encode()
    context = multiprocessing.get_context("spawn")
    flooding, stop, answers = context.Event(), context.Event(), context.Queue()
    num_sent, num_pending = context.Value("i", 0), context.Value("i", 0)
    flooder = context.Process(target=flood, args=(server.url, server.keys["flooder"], body, NUM_FLOODERS,
                                                  PAUSE_S, flooding, stop, num_sent, num_pending, answers))
    flooder.start()
    quiet, flooded = [], []
    try:
        with server.http(server.keys["victim"]) as http:
            _latencies(http, 1)  # a warm connection
            for _ in range(NUM_PHASES):
                flooding.clear()
                _wait(lambda: num_pending.value == 0, "the flood to pause")
                quiet += _latencies(http, SAMPLES_PER_PHASE)
                sent = num_sent.value
                flooding.set()
                _wait(lambda s=sent: num_sent.value >= s + 4 * NUM_FLOODERS, "the flood to run")
                flooded += _latencies(http, SAMPLES_PER_PHASE)
    finally:
        stop.set()
        statuses = answers.get(timeout=120)
        flooder.join(30)
    return statistics.median(quiet), statistics.median(flooded), statuses


@pytest.mark.parametrize("prompt", [
    pytest.param("How do I make tea? " * (PROMPT_BYTES // 19), id="4MB-prompts"),
    pytest.param("x" * 24_000, id="prompts-just-small-enough-to-tokenize"),
])
def test_a_flood_of_prompts_that_cannot_fit_does_not_slow_another_tenant(demo_server: Server,
                                                                        prompt: str) -> None:
    quiet, flooded, statuses = _latency_with_and_without_flood(demo_server, prompt)
    print(f"\n{len(prompt)}-character prompts: the other tenant's median latency {1000 * quiet:.1f} ms "
          f"without the flood, {1000 * flooded:.1f} ms with it ({flooded / quiet:.2f}x); the flood's "
          f"answers: {statuses}")
    assert set(statuses) <= {400, 413, "closed"}, statuses
    assert flooded <= 2 * quiet, (quiet, flooded)
