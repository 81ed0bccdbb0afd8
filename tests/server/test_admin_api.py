"""The admin REST API over a real server and registry (SQLite and PostgreSQL): tenants, keys,
adapters (multipart uploads streamed to the registry), system prompts, usage, engine state,
audit, and the OpenAPI document the admin UI is written against."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import openai
import pytest

from loraplex.adapter_format import load_adapter_dir
from tests.registry.registry_support import MAX_RANK, TINY
from tests.server.server_support import MODEL_ID, Server, upload_files


def test_tenants(server: Server) -> None:
    with server.http() as http:
        created = http.post("/admin/api/tenants", json={"name": "initech", "weight": 2.5,
                                                        "max_requests_per_minute": 100})
        assert created.status_code == 201, created.text
        assert created.json() | {"created_at": None} == {
            "name": "initech", "weight": 2.5, "max_concurrent_requests": None,
            "max_requests_per_minute": 100, "max_tokens_per_minute": None, "created_at": None,
            "requests_in_flight": 0}
        duplicate = http.post("/admin/api/tenants", json={"name": "initech"})
        assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "conflict"
        bad = http.post("/admin/api/tenants", json={"name": "../etc"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
        assert http.post("/admin/api/tenants", json={"name": "x", "weight": 0}).status_code == 400
        for weight in (1e-300, 1e4):  # outside what the service counters stay exact for
            refused = http.patch("/admin/api/tenants/initech", json={"weight": weight})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "weight", refused.text
        assert [t["name"] for t in http.get("/admin/api/tenants").json()] == ["acme", "globex", "initech"]
        patched = http.patch("/admin/api/tenants/initech", json={"max_concurrent_requests": 3,
                                                                 "max_requests_per_minute": None})
        assert patched.json()["max_concurrent_requests"] == 3
        assert patched.json()["max_requests_per_minute"] is None and patched.json()["weight"] == 2.5
        assert http.get("/admin/api/tenants/initech").json() == patched.json()
        assert http.get("/admin/api/tenants/nobody").status_code == 404
        assert http.delete("/admin/api/tenants/globex").status_code == 204
        assert http.get("/admin/api/tenants/globex").status_code == 404
    with pytest.raises(openai.AuthenticationError):  # its keys went with it
        server.openai("globex").models.list()


def test_keys(server: Server) -> None:
    with server.http() as http:
        created = http.post("/admin/api/keys", json={"tenant": "acme"})
        assert created.status_code == 201
        secret, key = created.json()["secret"], created.json()["key"]
        assert key["role"] == "tenant" and key["tenant"] == "acme" and secret.startswith(key["prefix"])
        assert server.openai(key=secret).models.list().data
        listing = http.get("/admin/api/keys")
        assert secret not in listing.text and "secret" not in listing.text and "hash" not in listing.text
        assert {k["id"] for k in http.get("/admin/api/keys", params={"tenant": "acme"}).json()} >= {key["id"]}
        revoked = http.post(f"/admin/api/keys/{key['id']}/revoke")
        assert revoked.json()["is_revoked"] is True
        with pytest.raises(openai.AuthenticationError):  # at once on this server
            server.openai(key=secret).models.list()
        admin = http.post("/admin/api/keys", json={"admin": True}).json()
        assert admin["key"]["role"] == "admin"
        assert http.post("/admin/api/keys", json={"tenant": "acme", "admin": True}).status_code == 400
        assert http.post("/admin/api/keys", json={"tenant": "nobody"}).status_code == 404
        assert http.post("/admin/api/keys/999999/revoke").status_code == 404
    with server.http(admin["secret"]) as http:
        assert http.get("/admin/api/me").json()["role"] == "admin"


def test_adapter_upload_list_serve_delete(server: Server, adapter_dirs) -> None:
    client = server.openai("globex")
    with server.http() as http:
        response = http.post("/admin/api/adapters", data={"tenant": "globex", "name": "fresh"},
                             files=upload_files(adapter_dirs["mlp"]))
        assert response.status_code == 201, response.text
        adapter = response.json()
        assert (adapter["tenant"], adapter["name"], adapter["rank"], adapter["base_model"]) == (
            "globex", "fresh", 8, MODEL_ID)
        assert adapter["target_modules"] == ["gate_proj", "up_proj", "down_proj"]
        weights = (adapter_dirs["mlp"] / "adapter_model.safetensors").read_bytes()
        assert adapter["size_bytes"] == len(weights)
        # One identity: the engine's digest of the tensors, and no other hash beside it.
        assert adapter["digest"] == load_adapter_dir(adapter_dirs["mlp"], TINY, MAX_RANK).digest
        assert not {"sha256", "config_sha256", "weights_sha256"} & adapter.keys()
        assert "path" not in response.text and str(server.registry.config.data_dir) not in response.text
        # Servable at once, by this server, without a restart.
        assert client.completions.create(model="fresh", prompt="x", max_tokens=3).usage.completion_tokens
        (listed,) = [a for a in http.get("/admin/api/adapters", params={"tenant": "globex"}).json()
                     if a["name"] == "fresh"]
        assert listed["num_requests_served"] == 1 and listed["is_loaded"] is True
        assert http.get("/admin/api/adapters/globex/fresh").json()["digest"] == adapter["digest"]
        assert {(a["tenant"], a["name"]) for a in http.get("/admin/api/adapters").json()} == {
            ("acme", "shared"), ("acme", "style"), ("globex", "fresh"), ("globex", "shared")}
        # Fields after the weights: the weights are spooled first, the result is the same.
        files = upload_files(adapter_dirs["qv"])
        late_fields = http.post("/admin/api/adapters", files={
            "adapter_model": files["adapter_model"], "adapter_config": files["adapter_config"],
            "tenant": (None, "globex"), "name": (None, "spooled")})
        assert late_fields.status_code == 201, late_fields.text
        assert late_fields.json()["digest"] == http.get("/admin/api/adapters/acme/style").json()["digest"]
        assert http.delete("/admin/api/adapters/globex/fresh").status_code == 204
        with pytest.raises(openai.NotFoundError):  # at once on this server
            client.completions.create(model="fresh", prompt="x", max_tokens=3)
        assert http.delete("/admin/api/adapters/globex/fresh").status_code == 404
        assert http.get("/admin/api/adapters/globex/fresh").json()["error"]["code"] == "model_not_found"


def test_system_prompts(server: Server) -> None:
    text = "You are a helpful assistant."
    with server.http() as http:
        created = http.post("/admin/api/prompts", json={"tenant": "acme", "name": "helper", "text": text,
                                                        "adapter": "style"})
        assert created.status_code == 201, created.text
        # cached_blocks: its KV is being computed as it is added (tests/server/test_system_prompts.py).
        assert created.json() | {"created_at": None, "cached_blocks": None} == {
            "tenant": "acme", "name": "helper", "adapter": "style", "text": text,
            "num_tokens": len(text.encode()), "created_at": None, "cached_blocks": None,
            "num_requests_using": 0}
        assert http.post("/admin/api/prompts", json={"tenant": "acme", "name": "helper",
                                                     "text": "again"}).status_code == 409
        assert http.post("/admin/api/prompts", json={"tenant": "acme", "name": "x", "text": "t",
                                                     "adapter": "missing"}).status_code == 404
        for bad in ("", "nul \x00 inside"):  # (PostgreSQL cannot store NUL)
            refused = http.post("/admin/api/prompts", json={"tenant": "acme", "name": "x", "text": bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "text"
        http.post("/admin/api/prompts", json={"tenant": "globex", "name": "plain", "text": "Hi"})
        assert [(p["tenant"], p["name"]) for p in http.get("/admin/api/prompts").json()] == [
            ("acme", "helper"), ("globex", "plain")]
        globex = http.get("/admin/api/prompts", params={"tenant": "globex"}).json()
        assert [p["name"] for p in globex] == ["plain"]
        assert http.get("/admin/api/prompts/acme/helper").json()["text"] == text
        assert http.delete("/admin/api/prompts/acme/helper").status_code == 204
        assert http.get("/admin/api/prompts/acme/helper").status_code == 404


def test_usage_over_an_hour_range(server: Server) -> None:
    now = datetime.now(timezone.utc).replace(minute=30, second=0, microsecond=0)
    for hours_ago, tokens in [(5, 10), (2, 20), (1, 40)]:
        server.registry.usage.record("acme", "style", prompt_tokens=tokens, completion_tokens=1,
                                     at=now - timedelta(hours=hours_ago))
    server.registry.usage.record("globex", None, prompt_tokens=7, completion_tokens=7, at=now)
    with server.http() as http:
        report = http.get("/admin/api/usage", params={
            "tenant": "acme", "since": (now - timedelta(hours=2)).isoformat(),
            "until": (now - timedelta(minutes=30)).isoformat()}).json()
        assert [r["prompt_tokens"] for r in report["rows"]] == [20, 40]
        assert report["totals"] == {"num_requests": 2, "prompt_tokens": 60, "completion_tokens": 2,
                                    "total_tokens": 62}
        assert http.get("/admin/api/usage").json()["totals"]["num_requests"] == 4
        naive = http.get("/admin/api/usage", params={"since": now.replace(tzinfo=None).isoformat()})
        assert naive.json()["totals"]["prompt_tokens"] == 7  # a time without a zone is UTC
        assert http.get("/admin/api/usage", params={"since": "yesterday"}).status_code == 400
        assert http.get("/admin/api/usage", params={"tenant": "nobody"}).status_code == 404


def test_engine_state_and_audit(server: Server) -> None:
    server.openai("acme").completions.create(model="style", prompt="x", max_tokens=2)
    with server.http() as http:
        state = http.get("/admin/api/engine").json()
        assert state["model"] == MODEL_ID and state["device"] == "cpu" and state["is_alive"] is True
        assert state["kv_blocks_total"] == 1024 and state["num_requests_running"] == 0
        style = http.get("/admin/api/adapters/acme/style").json()["digest"]
        resident = {a["digest"]: a for a in state["adapters_resident"]}
        assert resident[style]["names"] == ["acme/style"]
        assert 0 < resident[style]["device_bytes"] <= state["memory"]["lora_slot_bytes"]
        assert resident[style]["device_bytes"] % state["pool_page_bytes"] == 0  # whole pool pages
        assert state["num_generated_tokens"] >= 2 and state["num_adapter_slots"] == 4
        http.post("/admin/api/tenants", json={"name": "audited"})
        (entry, *_) = http.get("/admin/api/audit", params={"limit": 5}).json()
        me = http.get("/admin/api/me").json()
        assert (entry["action"], entry["object_id"], entry["actor_key_id"]) == (
            "tenant.create", "audited", me["key_id"])
        assert http.get("/admin/api/audit", params={"limit": 0}).status_code == 400


def test_the_engine_state_names_the_adapters_of_each_digest_in_the_registry(server: Server,
                                                                          adapter_dirs) -> None:
    """Names come from the registry as it is now: one never used is named, one deleted (by
    this server or another process) is not."""
    server.registry.adapters.upload_dir("acme", "twin", adapter_dirs["mlp"])  # as acme/shared
    server.openai("acme").completions.create(model="shared", prompt="x", max_tokens=1)
    with server.http() as http:
        digest = http.get("/admin/api/adapters/acme/shared").json()["digest"]

        def names() -> list[str]:
            (resident,) = [a for a in http.get("/admin/api/engine").json()["adapters_resident"]
                           if a["digest"] == digest]
            return resident["names"]

        assert names() == ["acme/shared", "acme/twin"]
        server.registry.adapters.delete("acme", "twin")  # as the CLI does, beside the server
        assert names() == ["acme/shared"]
        assert http.delete("/admin/api/adapters/acme/shared").status_code == 204
        assert names() == []


def test_the_openapi_document_describes_every_route(server: Server) -> None:
    with server.http() as http:
        document = http.get("/openapi.json").json()
    operations = [(path, method, operation) for path, item in document["paths"].items()
                  for method, operation in item.items()]
    assert {path for path, _, _ in operations} >= {
        "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/health",
        "/ready", "/metrics", "/admin/api/tenants", "/admin/api/tenants/{name}", "/admin/api/keys",
        "/admin/api/keys/{key_id}/revoke", "/admin/api/adapters", "/admin/api/adapters/{tenant}/{name}",
        "/admin/api/prompts", "/admin/api/prompts/{tenant}/{name}", "/admin/api/usage",
        "/admin/api/engine", "/admin/api/audit", "/admin/api/me"}
    for path, method, operation in operations:
        where = f"{method.upper()} {path}"
        assert operation.get("summary"), where
        responses = operation["responses"]
        assert "422" not in responses, where
        success = [code for code in responses if code.startswith("2")]
        assert success, where
        if path.startswith(("/v1", "/admin")):
            assert operation.get("security") == [{"apiKey": []}], where
            for code in ("401", "403"):
                assert responses[code]["content"]["application/json"]["schema"]["$ref"].endswith(
                    "/ErrorResponse"), where
        if operation.get("parameters") or operation.get("requestBody"):
            assert "400" in responses or "404" in responses, where
    upload = document["paths"]["/admin/api/adapters"]["post"]["requestBody"]["content"]
    assert set(upload["multipart/form-data"]["schema"]["required"]) == {
        "tenant", "name", "adapter_config", "adapter_model"}
