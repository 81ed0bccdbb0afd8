"""Drain: `loraplex serve`, sent SIGTERM while 20 streaming requests are in flight (one runs,
the others wait in the engine: `--max-num-seqs 1` keeps them in flight long enough), stops
admitting (readiness fails, a new request gets 503 with Retry-After; liveness still answers),
finishes all 20 and exits 0."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import openai

from loraplex.registry import Registry, RegistryConfig
from tests.server.test_serve_cli import loraplex_serve

NUM_STREAMS = 20
MAX_TOKENS = 48


def test_sigterm_drains_streams_then_exits_0(tmp_path: Path, model_dir: Path) -> None:
    data_dir = tmp_path / "data"
    with Registry.open(RegistryConfig(data_dir=data_dir)) as registry:
        registry.tenants.create("acme")
        key = registry.keys.create(tenant="acme").secret
    with loraplex_serve(data_dir, "--model", str(model_dir), "--model-name", "tiny-llama",
                        "--max-num-seqs", "1", "--shutdown-timeout", "60") as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0, timeout=120)
        results: dict[int, tuple[int, str | None]] = {}

        def stream(index: int) -> None:
            chunks = client.completions.create(model="tiny-llama", prompt=f"stream {index}", stream=True,
                                               max_tokens=MAX_TOKENS, temperature=0, extra_body={
                                                   "ignore_eos": True, "stream_options": {
                                                       "include_usage": True}})
            finish, usage = None, None
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                usage = chunk.usage or usage
            results[index] = (usage.completion_tokens if usage else 0, finish)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while _in_flight(served.url) < NUM_STREAMS:  # all admitted; one runs, the rest wait
            assert time.monotonic() < deadline
            time.sleep(0.01)
        served.process.send_signal(signal.SIGTERM)
        while httpx.get(f"{served.url}/ready", timeout=5).status_code == 200:
            pass
        assert httpx.get(f"{served.url}/health", timeout=5).status_code == 200
        refused = httpx.post(f"{served.url}/v1/completions", timeout=10,
                             headers={"Authorization": f"Bearer {key}"},
                             json={"model": "tiny-llama", "prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_draining"
        assert _in_flight(served.url) > 0  # refused while the drain still had work to finish
        for thread in threads:
            thread.join(120)
        assert served.process.wait(60) == 0
        assert results == {i: (MAX_TOKENS, "length") for i in range(NUM_STREAMS)}
        output = served.output()
        assert "drained in" in output and "Traceback" not in output


def _in_flight(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "loraplex:requests_in_flight")
