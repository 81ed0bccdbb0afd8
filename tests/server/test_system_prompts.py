"""Registered system prompts named in a request (`system_prompt` through the openai client's
`extra_body`): the answer equals the one to a request that sends the text itself, and the
engine holds the prompt's KV; another tenant's prompt name is 404; a prompt bound to adapter A
used with adapter B (or the base model) is 400; a chat request naming one may not bring its own
system message."""

from __future__ import annotations

import time

import openai
import pytest

from loraplex.registry import RegistryConfig
from tests.server.server_support import MODEL_ID, Server, serve

GREEDY = {"temperature": 0, "max_tokens": 8}
TEXT = "You are a terse assistant for the acme support desk. Answer in one short line. " * 2


def test_a_registered_prompt_answers_as_its_text_does(sqlite_server: Server, engine) -> None:
    server = sqlite_server
    server.registry.prompts.add("acme", "desk", TEXT, adapter="style")
    client = server.openai("acme")
    named = client.completions.create(model="style", prompt="Where is my order?",
                                      extra_body={"system_prompt": "desk"}, **GREEDY)
    sent = client.completions.create(model="style", prompt=TEXT + "Where is my order?", **GREEDY)
    assert named.choices[0].text == sent.choices[0].text
    assert named.usage.prompt_tokens == sent.usage.prompt_tokens
    held = [n for key, n in engine.pinned_prompts().items() if key.startswith("acme/desk/")]
    assert held == [len(TEXT) // engine.config.cache.block_size]  # its full blocks, held
    deadline = time.monotonic() + 10  # /metrics shows the engine's latest sampled stats
    while server.metric("loraplex:prefix_cache_hits_total") < engine.blocks.num_hit_tokens:
        assert time.monotonic() < deadline, "prefix cache hits never reached /metrics"
        time.sleep(0.1)
    assert 0 < server.metric("loraplex:prefix_cache_hits_total") <= server.metric(
        "loraplex:prefix_cache_queries_total")
    assert server.metric("loraplex:prefix_cache_evicted_blocks_total") >= 0
    messages = [{"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model="style", messages=messages,
                                          extra_body={"system_prompt": "desk"}, **GREEDY)
    chat_sent = client.chat.completions.create(
        model="style", messages=[{"role": "system", "content": TEXT}, *messages], **GREEDY)
    assert chat.choices[0].message.content == chat_sent.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as own_system:
        client.chat.completions.create(model="style", extra_body={"system_prompt": "desk"},
                                       messages=[{"role": "system", "content": "x"}, *messages], **GREEDY)
    assert own_system.value.body["param"] == "system_prompt"


def test_another_tenants_prompt_is_404_and_a_bound_prompt_serves_one_adapter(sqlite_server: Server) -> None:
    server = sqlite_server
    server.registry.prompts.add("acme", "desk", TEXT, adapter="style")
    with pytest.raises(openai.NotFoundError):
        server.openai("globex").completions.create(model="shared", prompt="Hi",
                                                   extra_body={"system_prompt": "desk"}, **GREEDY)
    for model in ("shared", MODEL_ID):
        with pytest.raises(openai.BadRequestError) as wrong:
            server.openai("acme").completions.create(model=model, prompt="Hi",
                                                     extra_body={"system_prompt": "desk"}, **GREEDY)
        assert wrong.value.body["param"] == "system_prompt"


def test_a_deleted_or_replaced_prompt_lets_its_blocks_go(sqlite_server: Server, engine) -> None:
    server = sqlite_server
    client = server.openai("acme")

    def held() -> list[str]:
        return [key for key in engine.pinned_prompts() if key.startswith("acme/desk/")]

    server.registry.prompts.add("acme", "desk", TEXT, adapter="style")
    client.completions.create(model="style", prompt="Hi", extra_body={"system_prompt": "desk"}, **GREEDY)
    assert len(held()) == 1
    assert server.http().delete("/admin/api/prompts/acme/desk").status_code == 204
    assert held() == []
    server.registry.prompts.add("acme", "desk", TEXT, adapter="style")
    client.completions.create(model="style", prompt="Hi", extra_body={"system_prompt": "desk"}, **GREEDY)
    first = held()
    server.registry.prompts.delete("acme", "desk")  # replaced behind the server's back
    server.registry.prompts.add("acme", "desk", "Be brief. " * 8, adapter="style")
    client.completions.create(model="style", prompt="Hi", extra_body={"system_prompt": "desk"}, **GREEDY)
    assert len(held()) == 1 and held() != first


def _held_forms(engine, prefix: str) -> dict[str, int]:
    """API form ("completions", "chat") -> blocks held, of the pins whose key starts with prefix."""
    return {key.split("/")[3]: n for key, n in engine.pinned_prompts().items() if key.startswith(prefix)}


def _wait_for_forms(engine, prefix: str) -> dict[str, int]:
    deadline = time.monotonic() + 20
    while not ((held := _held_forms(engine, prefix)).keys() == {"completions", "chat"}
               and all(held.values())):
        assert time.monotonic() < deadline, f"never warm: {held}"
        time.sleep(0.05)
    return held


def test_a_prompt_is_warm_from_its_registration_and_from_server_start(tmp_path, engine, adapter_dirs) -> None:
    config = RegistryConfig(data_dir=tmp_path / "data")
    with serve(config, engine, tenants=("acme",)) as server:
        server.registry.adapters.upload_dir("acme", "style", adapter_dirs["qv"])
        added = server.http().post("/admin/api/prompts", json={
            "tenant": "acme", "name": "warm", "text": TEXT, "adapter": "style"})
        assert added.status_code == 201, added.text
        held = _wait_for_forms(engine, "acme/warm/")  # before any request names it
        assert held["completions"] == len(TEXT) // engine.config.cache.block_size
        hits = engine.blocks.num_hit_tokens
        server.openai("acme").completions.create(model="style", prompt="Hi",
                                                 extra_body={"system_prompt": "warm"}, **GREEDY)
        # The first request that names it finds all its full blocks computed.
        assert engine.blocks.num_hit_tokens - hits >= held["completions"] * engine.config.cache.block_size
        with server.http() as http:
            (listed,) = [p for p in http.get("/admin/api/prompts").json() if p["name"] == "warm"]
            assert listed["cached_blocks"] == sum(held.values()) and listed["num_requests_using"] == 0
            stream = server.openai("acme").completions.create(
                model="style", prompt="Hi", stream=True, max_tokens=300,
                extra_body={"system_prompt": "warm", "ignore_eos": True})
            next(iter(stream))  # running now
            (listed,) = [p for p in http.get("/admin/api/prompts").json() if p["name"] == "warm"]
            stream.close()
            assert listed["num_requests_using"] == 1
            state = http.get("/admin/api/engine").json()
            assert 0 < state["prefix_cache_hits"] <= state["prefix_cache_queries"]
        hits = server.metric("vllm:prefix_cache_hits_total")  # vLLM v1's name, the same counter
        assert 0 < hits == server.metric("loraplex:prefix_cache_hits_total")
        for name in ("vllm:prefix_cache_queries_total", "loraplex:kv_blocks_shared",
                     "loraplex:relay_steps_total", "loraplex:relay_members_total"):
            server.metric(name)  # exported (KeyError otherwise)
    assert _held_forms(engine, "acme/warm/") == {}  # the server's pins went with it
    with serve(config, engine, tenants=()):  # a server starting on the registry warms it again
        _wait_for_forms(engine, "acme/warm/")
    assert _held_forms(engine, "acme/warm/") == {}


def test_resetting_the_prefix_cache_forgets_cached_prompts_but_keeps_registered_ones(
        sqlite_server: Server, engine) -> None:
    """POST /admin/api/engine/reset-prefix-cache (what `loraplex bench serve --reset-prefix-cache`
    calls between runs of one workload): a prompt sent again is computed again, a registered
    system prompt stays pinned; tenants' keys are refused."""
    server = sqlite_server
    server.registry.prompts.add("acme", "kept", TEXT, adapter="style")
    client = server.openai("acme")
    client.completions.create(model="style", prompt="Hi", extra_body={"system_prompt": "kept"}, **GREEDY)
    prompt = "Where is my order? It was due on Monday and has not come yet. " * 4
    client.completions.create(model="style", prompt=prompt, **GREEDY)
    pinned = {key: n for key, n in engine.pinned_prompts().items() if key.startswith("acme/kept/")}
    hits = engine.blocks.num_hit_tokens
    client.completions.create(model="style", prompt=prompt, **GREEDY)
    assert engine.blocks.num_hit_tokens > hits  # found cached
    with server.http() as http:
        reset = http.post("/admin/api/engine/reset-prefix-cache")
        assert reset.status_code == 200, reset.text
        assert reset.json()["dropped_blocks"] >= len(prompt) // 4 // engine.config.cache.block_size
        refused = http.post("/admin/api/engine/reset-prefix-cache",
                            headers={"Authorization": f"Bearer {server.keys['acme']}"})
        assert refused.status_code == 403, refused.text
    hits = engine.blocks.num_hit_tokens
    client.completions.create(model="style", prompt=prompt, **GREEDY)
    assert engine.blocks.num_hit_tokens == hits  # computed again
    assert {key: n for key, n in engine.pinned_prompts().items() if key.startswith("acme/kept/")} == pinned
    named = client.completions.create(model="style", prompt="Hi", extra_body={"system_prompt": "kept"},
                                      **GREEDY)
    assert named.choices[0].text is not None and engine.blocks.num_hit_tokens > hits  # still warm
