"""What a hostile client sends, through a real server: text that is not valid Unicode in every
field a client can send, and errors that must neither leak server paths nor fail with a 5xx."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.server.server_support import MODEL_ID, Server

JSON = {"content-type": "application/json"}
LONE = "\\ud800"
"""A lone UTF-16 surrogate as JSON writes it: valid JSON, not valid Unicode."""

COMPLETION = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# (path, body, the field the error must name): `@` marks where the lone surrogate goes.
SURROGATE_CASES = [
    ("/v1/completions", COMPLETION | {"prompt": "a@b"}, "prompt"),
    ("/v1/completions", COMPLETION | {"prompt": ["@"]}, "prompt.0"),
    ("/v1/completions", COMPLETION | {"stop": "@"}, "stop"),
    ("/v1/completions", COMPLETION | {"stop": ["ok", "@"]}, "stop.1"),
    ("/v1/completions", COMPLETION | {"model": "@"}, "model"),
    ("/v1/completions", COMPLETION | {"user": "@"}, "user"),
    ("/v1/completions", COMPLETION | {"suffix": "@"}, "suffix"),
    ("/v1/completions", COMPLETION | {"logit_bias": {"@": 1}}, "logit_bias"),
    ("/v1/completions", COMPLETION | {"@": 1}, None),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "@"}]}, "messages.0.content"),
    ("/v1/chat/completions", CHAT | {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "@"}]}]},
     "messages.0.content.1.text"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "x", "name": "@"}]},
     "messages.0.name"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "@", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", CHAT | {"stop": "@"}, "stop"),
    ("/v1/chat/completions", CHAT | {"user": "@"}, "user"),
    ("/v1/chat/completions", CHAT | {"metadata": {"a": [{"b": "@"}]}}, "metadata.a.0.b"),
    ("/admin/api/tenants", {"name": "@"}, "name"),
    ("/admin/api/keys", {"tenant": "@"}, "tenant"),
    ("/admin/api/prompts", {"tenant": "acme", "name": "p", "text": "be @ brief"}, "text"),
    ("/admin/api/prompts", {"tenant": "acme", "name": "p", "text": "x", "adapter": "@"}, "adapter"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES,
                         ids=[f"{path.removeprefix('/v1/').removeprefix('/admin/api/')}:{param}"
                              for path, _, param in SURROGATE_CASES])
def test_text_that_is_not_unicode_is_a_400_naming_the_field(sqlite_server: Server, path: str, body: dict,
                                                             param: str | None) -> None:
    key = sqlite_server.admin_key if path.startswith("/admin") else sqlite_server.keys["acme"]
    raw = json.dumps(body).replace("@", LONE).encode()
    with sqlite_server.http(key) as http:
        response = http.post(path, content=raw, headers=JSON)
    assert response.status_code == 400, response.text
    error = response.json()["error"]  # and the body is valid JSON in valid UTF-8
    assert error["param"] == param and error["code"] == "invalid_unicode", error
    assert "surrogate" in error["message"], error
    with sqlite_server.http() as http:  # nothing was stored
        assert [t["name"] for t in http.get("/admin/api/tenants").json()] == ["acme", "globex"]
        assert http.get("/admin/api/prompts").json() == []


@pytest.mark.parametrize("depth", [33, 900, 20_000])
def test_bodies_nested_too_deep_are_a_400(sqlite_server: Server, depth: int) -> None:
    """Within the JSON parser's own limit the body's check names the field; past it the
    parser's refusal is a 400 as well."""
    raw = json.dumps(CHAT | {"metadata": {"m": "@"}}).replace('"@"', "[" * depth + "]" * depth).encode()
    for path, key in (("/v1/chat/completions", sqlite_server.keys["acme"]),
                      ("/admin/api/prompts", sqlite_server.admin_key)):
        with sqlite_server.http(key) as http:
            response = http.post(path, content=raw, headers=JSON)
        assert response.status_code == 400, response.text
        if depth < 1000 and path.startswith("/v1"):
            error = response.json()["error"]
            assert error["code"] == "nested_too_deep" and error["param"] == "metadata.m" + ".0" * 30, error
            assert "deeper than 32 levels" in error["message"]


def test_a_revoked_key_is_refused_at_once_under_load(sqlite_server: Server) -> None:
    """Clients keep calling with a key while it is revoked; no call that starts after the revoke
    returned may succeed. (A key read from the registry just before the revoke must not be
    cached after it: tests/server/test_principals.py makes that race happen; here it may.)"""
    for _ in range(3):
        late = _calls_that_outlive_a_revocation(sqlite_server)
        assert not late, f"calls after the revocation that were not refused (s after, status): {late}"


def _calls_that_outlive_a_revocation(server: Server, num_clients: int = 4) -> list[tuple[float, int]]:
    with server.http() as admin:
        created = admin.post("/admin/api/keys", json={"tenant": "acme"}).json()
    stop = threading.Event()
    calls: list[tuple[float, int]] = []

    def call_until_stopped() -> None:
        with server.http(created["secret"]) as http:
            while not stop.is_set():
                started = time.monotonic()
                calls.append((started, http.get("/v1/models").status_code))

    threads = [threading.Thread(target=call_until_stopped) for _ in range(num_clients)]
    for thread in threads:
        thread.start()
    try:
        while sum(status == 200 for _, status in calls) < 20:
            time.sleep(0.01)
        with server.http() as admin:
            assert admin.post(f"/admin/api/keys/{created['key']['id']}/revoke").status_code == 200
        revoked_at = time.monotonic()
        while sum(started > revoked_at for started, _ in calls) < 40:
            time.sleep(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return [(round(started - revoked_at, 3), status) for started, status in calls
            if started > revoked_at and status != 401]


def test_max_tokens_is_bound_by_the_context_left_after_the_prompt(sqlite_server: Server) -> None:
    """The test model's context is 512 tokens; a prompt of 2 leaves 510 (no server cap by
    default: what the context allows is what a request may ask for)."""
    with sqlite_server.http(sqlite_server.keys["acme"]) as http:
        for body in (COMPLETION | {"max_tokens": 5000}, COMPLETION | {"max_tokens": 511},
                     CHAT | {"max_completion_tokens": 10**30, "max_tokens": None}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = http.post(path, json={k: v for k, v in body.items() if v is not None})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            asked = body.get("max_tokens") or body["max_completion_tokens"]
            room = 510 if path == "/v1/completions" else 512 - 25  # the chat template's 25 tokens
            assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded", error
            assert f"max_tokens is {asked}, but only {room} tokens are left in this model's context of " \
                   f"512 tokens" in error["message"], error
        long_prompt = COMPLETION | {"prompt": "x" * 500, "ignore_eos": True}
        fits = http.post("/v1/completions", json=long_prompt | {"max_tokens": 12})
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 12, fits.text
        assert "only 12 tokens are left" in http.post("/v1/completions", json=long_prompt | {
            "max_tokens": 13}).json()["error"]["message"]


def test_refused_requests_count_against_the_senders_limits(sqlite_server: Server) -> None:
    """A tenant limited to 3 requests a minute sends 3 that are refused (a bad parameter, a
    prompt too long for the context, an unknown adapter): the 4th, a good one, is over the
    limit. Another tenant is not affected."""
    with sqlite_server.http() as admin:
        assert admin.patch("/admin/api/tenants/acme", json={"max_requests_per_minute": 3}).status_code == 200
    with sqlite_server.http(sqlite_server.keys["acme"]) as http:
        refused = [http.post("/v1/completions", json=COMPLETION | change).status_code for change in (
            {"temperature": -1}, {"prompt": "x" * 5000}, {"model": "nothing-of-that-name"})]
        assert refused == [400, 400, 404]
        over = http.post("/v1/completions", json=COMPLETION)
        assert over.status_code == 429 and over.headers["x-ratelimit-remaining-requests"] == "0", over.text
    with sqlite_server.http(sqlite_server.keys["globex"]) as http:
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized(sqlite_server: Server) -> None:
    """The test model's context is 512 tokens and its tokenizer's longest token 5 bytes: 3000
    bytes are at least 600 tokens, whatever they say. A body larger than any request that fits
    needs is refused before it is read."""
    with sqlite_server.http(sqlite_server.keys["acme"]) as http:
        for path, body, param in (
                ("/v1/completions", COMPLETION | {"prompt": "é" * 1500}, "prompt"),
                ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "a" * 2000},
                                                              {"role": "user", "content": "b" * 1000}]},
                 "messages")):
            error = http.post(path, json=body).json()["error"]
            assert (error["code"], error["param"]) == ("context_length_exceeded", param), error
            assert "The prompt is 3000 bytes long: at least 600 tokens" in error["message"], error
            assert "It was not tokenized" in error["message"]
        huge = http.post("/v1/completions", json=COMPLETION | {"prompt": "x" * 4_000_000})
        assert huge.status_code == 413 and "no request whose prompt fits this model (511 tokens at most) " \
                                          "needs more" in huge.json()["error"]["message"], huge.text
