"""`loraplex bench serve`'s time limit: requests still going when it passes are dropped and
counted as failures (`time_limit`), and the others are reported as usual."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.benchmarks import serve_bench
from loraplex.benchmarks.serve_bench import Progress, RequestResult, Target, report, run_requests
from loraplex.benchmarks.serve_workload import WorkloadConfig, make_workload


def test_requests_past_the_time_limit_fail_and_the_rest_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = make_workload(WorkloadConfig(num_prompts=4, num_tenants=1, prompt_len=4, output_len=2,
                                            vocab_size=100))
    slow = {requests[3].prompt_token_ids[0]}

    async def fake_stream(url: str, key: str, body: dict) -> RequestResult:
        await asyncio.sleep(30 if body["prompt"][0] in slow else 0.01)
        return RequestResult(-1, 200, ttft_s=0.005, latency_s=0.01, output_tokens=2)

    monkeypatch.setattr(serve_bench, "stream_completion", fake_stream)
    target = Target("http://127.0.0.1:1", "m", {"t000": "k"}, 100)
    results, duration = asyncio.run(run_requests(target, requests, None, Progress(4, "test"), 0.5))
    assert duration < 5
    assert [r.index for r in results] == [0, 1, 2, 3]
    summary = report(results, duration, requests, 1.0, 0.1)
    assert summary["completed"] == 3
    assert summary["errors_by_status"] == {"time_limit": 1}


def test_the_servers_cpu_per_token_is_split_by_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's /metrics (its thread CPU collector) read as the benchmark reads them: the
    engine thread's CPU shows under `engine`, this thread's (the event loop's) under
    `event_loop`, and each as ms per generated token over the run."""
    import io
    import threading
    import time

    from loraplex.engine.async_engine import ENGINE_THREAD_NAME
    from loraplex.server.metrics import Metrics
    from loraplex.server.monitor import EngineMonitor

    monitor = EngineMonitor.__new__(EngineMonitor)
    monitor.latest = None
    metrics = Metrics("m", monitor, lambda: 0)
    monkeypatch.setattr("urllib.request.urlopen", lambda url, timeout: io.BytesIO(metrics.render()))

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    burned, release = threading.Event(), threading.Event()

    def engine_work() -> None:
        burn(0.3)
        burned.set()
        release.wait()  # alive (its clock readable) until the last scrape

    before = serve_bench.scrape_counters("http://server")
    engine = threading.Thread(target=engine_work, name=ENGINE_THREAD_NAME)
    engine.start()
    try:
        engine.join(0.05)  # still running when scraped below
        burn(0.1)
        after = serve_bench.scrape_counters("http://server")
        assert burned.wait(30)
        # The process's figure against the threads' once the engine thread is idle (while it
        # runs, the collectors read the two a moment apart).
        settled = serve_bench.scrape_counters("http://server")
    finally:
        release.set()
        engine.join()
    for scrape in (after, settled):
        scrape["generation_tokens"] = before["generation_tokens"] + 1000
    counters = serve_bench.engine_counters(before, after)
    assert 0.1 <= counters["event_loop_cpu_s"] < 0.25
    assert 0.05 < counters["engine_thread_cpu_s"] <= 0.3
    assert counters["event_loop_cpu_ms_per_token"] == pytest.approx(counters["event_loop_cpu_s"], abs=1e-3)
    settled = serve_bench.engine_counters(before, settled)
    assert settled["engine_thread_cpu_s"] == pytest.approx(0.3, abs=0.02)
    threads = settled["event_loop_cpu_s"] + settled["engine_thread_cpu_s"]
    assert settled["server_cpu_s"] >= threads - 0.03  # the process's figure counts 10 ms ticks

def test_fairness_preemptions_are_counted_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    from types import SimpleNamespace

    from loraplex.server.metrics import Metrics
    from tests.server.test_epp_metrics import _stats

    monitor = SimpleNamespace(latest=None)
    metrics = Metrics("m", monitor, lambda: 0)  # type: ignore[arg-type]
    monkeypatch.setattr("urllib.request.urlopen", lambda url, timeout: io.BytesIO(metrics.render()))
    snapshot = SimpleNamespace(sampled_wall=0.0, tokens_per_second=0.0)
    monitor.latest = SimpleNamespace(**vars(snapshot), stats=_stats(
        num_preemptions=3, preemptions={"fairness:recompute": 1, "kv:swap": 2}))
    before = serve_bench.scrape_counters("http://server")
    monitor.latest = SimpleNamespace(**vars(snapshot), stats=_stats(
        num_preemptions=10, preemptions={"fairness:recompute": 5, "fairness:swap": 2, "kv:swap": 3}))
    counters = serve_bench.engine_counters(before, serve_bench.scrape_counters("http://server"))
    assert counters["preemptions"] == 7
    assert counters["fairness_preemptions"] == 6
