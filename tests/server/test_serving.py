"""Serving under pressure: concurrent clients (usage exact on SQLite and PostgreSQL), clients
that leave (engine work aborted), tenant limits and a full server (429/503 with Retry-After),
an engine failure in mid-stream, metrics and health."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from loraplex.registry import RegistryConfig
from tests.server.server_support import MODEL_ID, Server, make_engine, serve

LONG = 480
"""max_tokens that keeps a request busy for seconds (the context is 512)."""
HOLD = {"max_tokens": LONG, "ignore_eos": True, "stream": True}


def _wait_until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _engine(server: Server) -> dict:
    with server.http() as http:
        return http.get("/admin/api/engine").json()


def test_concurrent_clients_lose_nothing(server: Server) -> None:
    """Several threads, mixed tenants, adapters, streaming and not: every request answered, and
    the usage the registry recorded is exactly the sum of the usage the clients were told."""
    plan = [(tenant, model, stream) for tenant, model in [("acme", "style"), ("acme", MODEL_ID),
                                                          ("acme", "shared"), ("globex", "shared")]
            for stream in (False, True)] * 5
    random.Random(0).shuffle(plan)

    def call(job: tuple[str, str, bool]) -> tuple[str, str | None, int, int]:
        tenant, model, stream = job
        client = server.openai(tenant)
        max_tokens = random.Random(hash(job)).randint(1, 12)
        if stream:
            chunks = list(client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"{tenant} {model}"}],
                max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(model=model, prompt=f"{tenant}/{model}",
                                              max_tokens=max_tokens).usage
        assert usage.completion_tokens <= max_tokens
        return tenant, None if model == MODEL_ID else model, usage.prompt_tokens, usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, plan))
    assert len(results) == len(plan)
    expected: Counter = Counter()
    for tenant, adapter, prompt, completion in results:
        expected[(tenant, adapter, "requests")] += 1
        expected[(tenant, adapter, "prompt")] += prompt
        expected[(tenant, adapter, "completion")] += completion
    with server.http() as http:
        report = http.get("/admin/api/usage").json()
    recorded: Counter = Counter()
    for row in report["rows"]:
        key = (row["tenant"], row["adapter"])
        recorded[(*key, "requests")] += row["num_requests"]
        recorded[(*key, "prompt")] += row["prompt_tokens"]
        recorded[(*key, "completion")] += row["completion_tokens"]
    assert recorded == expected
    assert server.metric("loraplex:requests_in_flight") == 0


def test_a_client_that_leaves_a_stream_stops_its_engine_work(sqlite_server: Server) -> None:
    server = sqlite_server
    with server.http(server.keys["acme"]) as http, http.stream("POST", "/v1/completions", json={
            "model": "style", "prompt": "go on", **HOLD}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert _engine(server)["num_requests_running"] == 1
    # The connection is closed: the engine request is aborted, not run to its end.
    _wait_until(lambda: _engine(server)["num_requests_running"] == 0, 5, "the running count to drop")
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("loraplex:requests_in_flight") == 0
    assert server.metric("loraplex:requests_aborted_total") == 1
    with server.http() as http:
        (row,) = http.get("/admin/api/usage", params={"tenant": "acme"}).json()["rows"]
    assert row["num_requests"] == 1 and 0 < row["completion_tokens"] < LONG


def test_a_client_that_leaves_before_its_answer_stops_its_engine_work(sqlite_server: Server) -> None:
    server = sqlite_server
    body = json.dumps({"model": MODEL_ID, "prompt": "wait", "max_tokens": LONG, "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.keys['acme']}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request)
        _wait_until(lambda: _engine(server)["num_generated_tokens"] > 0, 5, "generation to start")
        assert _engine(server)["num_requests_running"] == 1
    _wait_until(lambda: _engine(server)["num_requests_running"] == 0, 5, "the running count to drop")
    _wait_until(lambda: server.metric("loraplex:requests_in_flight") == 0, 5, "the request to end")
    with server.http() as http:
        (row,) = http.get("/admin/api/usage", params={"tenant": "acme"}).json()["rows"]
    assert row["completion_tokens"] < LONG


def test_tenant_limits_answer_429_with_retry_after(sqlite_server: Server) -> None:
    server = sqlite_server
    client = server.openai("acme")
    with server.http() as admin:
        assert admin.patch("/admin/api/tenants/acme", json={"max_concurrent_requests": 1}).status_code == 200
        with server.http(server.keys["acme"]) as http, http.stream("POST", "/v1/completions", json={
                "model": MODEL_ID, "prompt": "hold", **HOLD}) as held:
            lines = held.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)
            with pytest.raises(openai.RateLimitError) as caught:
                client.completions.create(model=MODEL_ID, prompt="x", max_tokens=1)
            assert caught.value.code == "rate_limit_exceeded"
            assert int(caught.value.response.headers["retry-after"]) >= 1
            assert server.openai("globex").completions.create(model=MODEL_ID, prompt="x", max_tokens=1)
            assert admin.get("/admin/api/tenants/acme").json()["requests_in_flight"] == 1
        _wait_until(lambda: server.metric("loraplex:requests_in_flight") == 0, 5, "the stream to end")
        assert client.completions.create(model=MODEL_ID, prompt="x", max_tokens=1).choices

        admin.patch("/admin/api/tenants/acme", json={"max_concurrent_requests": None,
                                                     "max_requests_per_minute": 2})
        for _ in range(2):
            client.completions.create(model=MODEL_ID, prompt="x", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL_ID, prompt="x", max_tokens=1)
        headers = caught.value.response.headers
        assert 1 <= int(headers["retry-after"]) <= 60
        assert headers["x-ratelimit-limit-requests"] == "2"
        assert headers["x-ratelimit-remaining-requests"] == "0"

        admin.patch("/admin/api/tenants/acme", json={"max_requests_per_minute": None,
                                                     "max_tokens_per_minute": 50})
        with pytest.raises(openai.RateLimitError) as caught:  # can never fit: do not retry
            client.completions.create(model=MODEL_ID, prompt="x", max_tokens=60)
        assert caught.value.response.headers["x-should-retry"] == "false"
        client.completions.create(model=MODEL_ID, prompt="xy", max_tokens=20)  # 22 tokens reserved
        client.completions.create(model=MODEL_ID, prompt="xy", max_tokens=20)
        with pytest.raises(openai.RateLimitError):  # 44 used, 22 more would pass 50
            client.completions.create(model=MODEL_ID, prompt="xy", max_tokens=20)
    assert server.metric("loraplex:requests_rejected_total", reason="rate_limit") == 4


def test_a_full_server_answers_503_with_retry_after(tmp_path: Path, engine) -> None:
    with serve(RegistryConfig(data_dir=tmp_path / "data"), engine, max_requests_in_flight=1) as server:
        with server.http(server.keys["acme"]) as http, http.stream("POST", "/v1/completions", json={
                "model": MODEL_ID, "prompt": "hold", **HOLD}) as held:
            lines = held.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)
            response = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "x", "max_tokens": 1})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "server_overloaded"


def test_an_engine_failure_mid_stream_is_an_error_event(sqlite_server: Server, engine) -> None:
    """Fault injection at the model boundary (as a GPU error would): the stream ends with an
    error event, the client raises, and the engine keeps serving."""
    server = sqlite_server
    real_begin = engine.runner.begin  # where the engine queues a step's forward pass
    failing = threading.Event()

    def begin(plan):
        if failing.is_set():
            raise RuntimeError("injected device failure")
        return real_begin(plan)

    engine.runner.begin = begin
    try:
        client = server.openai("acme")
        stream = client.chat.completions.create(model="style", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=LONG, stream=True, extra_body={"ignore_eos": True})
        next(stream)
        failing.set()
        with pytest.raises(openai.APIError, match="the engine failed on this request"):
            for _ in stream:
                pass
        failing.clear()
        with server.http(server.keys["acme"]) as http:  # not streaming: a 500 with a request id
            failing.set()
            response = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "x", "max_tokens": 3})
            failing.clear()
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
        assert client.completions.create(model="style", prompt="still fine", max_tokens=3).choices
    finally:
        engine.runner.begin = real_begin
    assert server.metric("loraplex:requests_in_flight") == 0


def test_metrics_health_and_readiness(sqlite_server: Server) -> None:
    server = sqlite_server
    completion = server.openai("acme").completions.create(model="style", prompt="measure", max_tokens=5)
    usage, reason = completion.usage, completion.choices[0].finish_reason
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").json() == {"status": "ready", "model": MODEL_ID}
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:request_success_total", "loraplex:lora_adapters_resident",
                 "loraplex:generation_tokens_per_second", "loraplex:requests_in_flight"):
        assert name in text, name
    assert server.metric("vllm:prompt_tokens_total") == usage.prompt_tokens
    assert server.metric("vllm:generation_tokens_total") == usage.completion_tokens
    assert server.metric("vllm:e2e_request_latency_seconds_count") == 1
    # Sampled at the default temperature, the demo model may end on its end-of-text token.
    assert reason in ("length", "stop")
    assert server.metric("vllm:request_success_total", finished_reason=reason) == 1


def test_adapters_are_loaded_lazily_shared_by_identity_and_dropped_past_the_cap(
        tmp_path: Path, model_dir: Path, adapter_dirs) -> None:
    # Its own engine (no adapter loaded by other tests), whose host tier holds two adapters of
    # the largest rank (8): qv and qv2 are rank 4, mlp rank 8, and a load reserves room for 8.
    engine = make_engine(model_dir, max_cpu_loras=2)
    with serve(RegistryConfig(data_dir=tmp_path / "data"), engine, tenants=("acme", "globex")
               ) as server, server.http() as http:
        for tenant, name, folder in [("acme", "a", "qv"), ("acme", "b", "mlp"), ("acme", "c", "qv2"),
                                     ("globex", "same-as-a", "qv")]:
            server.registry.adapters.upload_dir(tenant, name, adapter_dirs[folder])

        def loaded() -> tuple[set[str], int]:
            """(acme's adapters in the engine's host tier, adapters in that tier)."""
            names = {a["name"] for a in http.get("/admin/api/adapters", params={"tenant": "acme"}).json()
                     if a["is_loaded"]}
            return names, http.get("/admin/api/engine").json()["num_adapters_on_host"]

        def resident() -> set[str]:
            return {a["name"] for a in http.get("/admin/api/adapters", params={"tenant": "acme"}).json()
                    if a["is_resident"]}

        def ask(tenant: str, model: str) -> str:
            return server.openai(tenant).completions.create(model=model, prompt="x", max_tokens=2,
                                                            temperature=0).choices[0].text

        assert loaded() == (set(), 0)  # nothing is loaded before it is used
        first = ask("acme", "a")
        assert ask("globex", "same-as-a") == first
        assert loaded() == ({"a"}, 1)  # two tenants, one identity, one copy
        ask("acme", "b")
        ask("acme", "c")  # no room for a third: the least recently used one (a) is dropped
        assert loaded() == ({"b", "c"}, 2)
        assert resident() == {"a", "b", "c"}  # the device's four slots still hold all three
        # Each resident adapter's device bytes are the pool pages its own rank and modules take
        # (no more than the largest adapter's); the pool's pages by kind add up, the three
        # adapters' lent; /metrics shows the same.
        state = http.get("/admin/api/engine").json()
        memory, pages = state["memory"], state["pool_pages"]
        device_bytes = {a["name"]: a["device_bytes"]
                        for a in http.get("/admin/api/adapters", params={"tenant": "acme"}).json()}
        assert all(0 < n <= memory["lora_slot_bytes"] and n % memory["kv_block_bytes"] == 0
                   for n in device_bytes.values())
        assert sorted(r["device_bytes"] for r in state["adapters_resident"]) == sorted(device_bytes.values())
        assert sum(pages.values()) == memory["num_pool_blocks"]
        assert pages["adapters"] * memory["kv_block_bytes"] == sum(device_bytes.values())
        assert state["adapter_wait"]["num_requests"] >= 4 and state["num_adapter_evictions"] == 0
        assert server.metric("loraplex:pool_pages", kind="adapters") == pages["adapters"]
        assert server.metric("loraplex:lora_adapter_wait_seconds_count") >= 4
        host_loads = http.get("/admin/api/engine").json()["num_adapter_host_loads"]
        assert ask("acme", "a") == first  # served from its slot: not read again
        assert http.get("/admin/api/engine").json()["num_adapter_host_loads"] == host_loads


def test_the_admin_ui_is_served_beside_the_api(tmp_path: Path, engine) -> None:
    ui = tmp_path / "ui"
    ui.mkdir()
    (ui / "index.html").write_text("<!doctype html><title>loraplex admin</title>")
    with serve(RegistryConfig(data_dir=tmp_path / "data"), engine, admin_ui_dir=ui) as server:
        page = httpx.get(f"{server.url}/admin/", timeout=10)
        assert page.status_code == 200 and "loraplex admin" in page.text
        with server.http() as http:
            assert http.get("/admin/api/me").json()["role"] == "admin"


def test_the_api_docs_load_nothing_from_other_hosts(sqlite_server: Server) -> None:
    """/docs (Swagger UI) and /redoc name only this server's own assets, and it serves them.
    (tests/ui/test_api_docs.py renders them in a browser cut off from other hosts.)"""
    with httpx.Client(base_url=sqlite_server.url, timeout=30) as http:
        for page in ("/docs", "/redoc"):
            html = http.get(page).text
            urls = re.findall(r"""(?:src|href)=["']([^"']+)["']|url: *["']([^"']+)["']""", html)
            urls = [a or b for a, b in urls]
            assert urls and not [u for u in urls if "://" in u or u.startswith("//")], (page, urls)
            assert "googleapis" not in html and "jsdelivr" not in html, page
            for url in urls:
                assert http.get(url).status_code == 200, url


def test_a_failing_registry_database_answers_503_and_recovers(sqlite_server: Server) -> None:
    """The SQLite file moved away under the running server (new connections find an empty
    database): requests that need the registry get 503 with Retry-After, not a 500."""
    server = sqlite_server
    database = server.registry.config.data_dir / "registry.db"
    files = [database.with_name(database.name + suffix) for suffix in ("", "-wal", "-shm")]
    time.sleep(0.3)  # past the server's cache of keys
    server.registry.db.dispose()
    for path in files:
        if path.exists():
            path.rename(path.with_name(path.name + ".away"))
    try:
        response = httpx.get(f"{server.url}/v1/models", timeout=10,
                             headers={"Authorization": f"Bearer {server.keys['acme']}"})
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "registry_unavailable"
        assert response.headers["retry-after"] == "1" and response.headers["x-request-id"]
        assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 503
    finally:
        server.registry.db.dispose()
        for path in files:
            path.unlink(missing_ok=True)
            away = path.with_name(path.name + ".away")
            if away.exists():
                away.rename(path)
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    assert server.openai("acme").models.list().data


def test_each_request_reaches_the_engine_with_its_tenant_and_adapter_digest(sqlite_server: Server,
                                                                             engine) -> None:
    """The server tells the engine who asks (the tenant) and which adapter (its digest), and
    the engine's own state shows requests by tenant."""
    seen: list[tuple[str, str | None]] = []
    scheduler = engine.scheduler
    add = scheduler.add
    scheduler.add = lambda request: seen.append((request.tenant, request.adapter)) or add(request)
    try:
        server = sqlite_server
        server.openai("acme").completions.create(model="style", prompt="x", max_tokens=1)
        server.openai("globex").chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "y"}], max_tokens=1)
    finally:
        scheduler.add = add
    style = server.registry.adapters.get("acme", "style").digest
    assert seen == [("acme", style), ("globex", None)]
    with server.http() as http:
        stream = threading.Thread(target=lambda: server.openai("acme").completions.create(
            model="style", prompt="z", max_tokens=200, extra_body={"ignore_eos": True}))
        stream.start()
        def acme() -> dict:  # the tenant is listed with its service from earlier requests too
            return http.get("/admin/api/engine").json()["requests_by_tenant"].get("acme") or {}

        _wait_until(lambda: acme().get("running", 0) + acme().get("waiting", 0), 10,
                    "acme's request in the engine")
        state = acme()
        assert state["running"] + state["waiting"] == 1
        stream.join()


def test_tenant_weights_reach_the_engine_and_fairness_shows_in_metrics(sqlite_server: Server,
                                                                       engine) -> None:
    """A weight changed through the admin API is in the engine's tenant table before the next
    request; one changed elsewhere (the CLI, another replica) arrives with the tenant's next
    request after the registry cache's time to live. /metrics and the admin engine API show
    each tenant's service, requests and swapping."""
    server = sqlite_server
    with server.http() as http:
        http.patch("/admin/api/tenants/acme", json={"weight": 3}).raise_for_status()
        _wait_until(lambda: engine.tenants.weight("acme") == 3.0, 5, "the new weight in the engine")
        server.registry.tenants.update("acme", weight=5)  # as another process would
        time.sleep(0.3)  # past the test server's registry cache time to live
        before = http.get("/admin/api/engine").json()["requests_by_tenant"]
        prompt = [5, 6, 7, 8]  # the same work for both tenants: 4 prompt tokens, 3 generated
        server.openai("acme").completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3,
                                                 extra_body={"ignore_eos": True})
        assert engine.tenants.weight("acme") == 5.0
        server.openai("globex").completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3,
                                                   extra_body={"ignore_eos": True})
        after = http.get("/admin/api/engine").json()["requests_by_tenant"]
    gained = {t: after[t]["service"] - before.get(t, {"service": 0.0})["service"] for t in ("acme", "globex")}
    assert after["acme"]["weight"] == 5.0
    assert gained["globex"] == pytest.approx(4 + 2 * 3), (before, after)
    assert gained["acme"] == pytest.approx((4 + 2 * 3) / 5), (before, after)
    _wait_until(lambda: server.metric("loraplex:tenant_service", tenant="globex")
                == pytest.approx(after["globex"]["service"]), 5, "the service in /metrics")
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("loraplex:tenant_requests_running", "loraplex:tenant_requests_waiting",
                 "loraplex:tenant_requests_swapped", "loraplex:kv_swap_bytes_total",
                 "loraplex:kv_swap_seconds_total", "loraplex:kv_swap_stall_seconds_total",
                 "loraplex:kv_host_pool_blocks"):
        assert name in text, name
