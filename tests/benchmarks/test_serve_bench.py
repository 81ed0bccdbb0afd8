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
