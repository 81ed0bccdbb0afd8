"""A property-based fuzz of every field a client sends as JSON or in a URL: each operation of the
live server's OpenAPI document starts from a request that works, and Hypothesis replaces one to
three of its fields (found by walking the operation's schema: body fields at any depth, path
and query parameters) with hostile values: text from every Unicode category (lone surrogates,
controls, private use, unassigned), huge, tiny, negative, non-finite numbers, deep nesting, and
values of the wrong type. No answer may be a 5xx, and every answer must be well-formed (a JSON
error body naming its problem; a stream of JSON events). Derandomized, bounded: about a minute.

(tests/server/test_schemathesis.py checks conformance to the document with generated requests;
this test aims at the values that break servers, where that one aims at the document.)"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from loraplex.registry import RegistryConfig
from tests.registry.registry_support import write_adapter
from tests.server.server_support import MODEL_ID, Server, serve

MAX_EXAMPLES = 60
MAX_SCHEMA_DEPTH = 6
"""Body fields are followed this many names and indexes deep."""
# A request that works, for each operation (path parameters filled in); an operation the
# document has and this table lacks fails the test: every endpoint is fuzzed.
VALID: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/completions"): {"body": {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2}},
    ("POST", "/v1/chat/completions"): {"body": {
        "model": "style", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 2}},
    ("GET", "/v1/models"): {},
    ("GET", "/v1/models/{model}"): {"path": {"model": "style"}},
    ("GET", "/health"): {},
    ("GET", "/ready"): {},
    ("GET", "/metrics"): {},
    ("GET", "/admin/api/tenants"): {},
    ("POST", "/admin/api/tenants"): {"body": {"name": "fuzzed", "weight": 2, "max_concurrent_requests": 4,
                                              "max_requests_per_minute": 600,
                                              "max_tokens_per_minute": 100000}},
    ("GET", "/admin/api/tenants/{name}"): {"path": {"name": "acme"}},
    ("PATCH", "/admin/api/tenants/{name}"): {"path": {"name": "acme"}, "body": {
        "weight": 1.5, "max_concurrent_requests": None, "max_requests_per_minute": None,
        "max_tokens_per_minute": None}},
    ("DELETE", "/admin/api/tenants/{name}"): {"path": {"name": "nobody"}},
    ("GET", "/admin/api/keys"): {"query": {"tenant": "acme"}},
    ("POST", "/admin/api/keys"): {"body": {"tenant": "acme", "admin": False}},
    ("POST", "/admin/api/keys/{key_id}/revoke"): {"path": {"key_id": 999999}},
    ("GET", "/admin/api/me"): {},
    ("GET", "/admin/api/adapters"): {"query": {"tenant": "acme"}},
    ("GET", "/admin/api/adapters/{tenant}/{name}"): {"path": {"tenant": "acme", "name": "style"}},
    ("DELETE", "/admin/api/adapters/{tenant}/{name}"): {"path": {"tenant": "acme", "name": "nothing"}},
    ("GET", "/admin/api/prompts"): {"query": {"tenant": "acme"}},
    ("POST", "/admin/api/prompts"): {"body": {"tenant": "acme", "name": "fuzzed", "text": "Be brief.",
                                              "adapter": "style"}},
    ("GET", "/admin/api/prompts/{tenant}/{name}"): {"path": {"tenant": "acme", "name": "fuzzed"}},
    ("DELETE", "/admin/api/prompts/{tenant}/{name}"): {"path": {"tenant": "acme", "name": "nothing"}},
    ("GET", "/admin/api/documents"): {"query": {"tenant": "acme"}},
    ("POST", "/admin/api/documents"): {"body": {"tenant": "acme", "name": "fuzzed", "text": "30 days."}},
    ("GET", "/admin/api/documents/{tenant}/{name}"): {"path": {"tenant": "acme", "name": "fuzzed"}},
    ("DELETE", "/admin/api/documents/{tenant}/{name}"): {"path": {"tenant": "acme", "name": "nothing"}},
    ("GET", "/admin/api/usage"): {"query": {"tenant": "acme", "adapter": "style",
                                            "since": "2024-01-01T00:00:00Z", "until": "2030-01-01T00:00:00"}},
    ("GET", "/admin/api/audit"): {"query": {"limit": 5, "before_id": 1000, "object_type": "tenant"}},
    ("GET", "/admin/api/engine"): {},
    ("POST", "/admin/api/engine/reset-prefix-cache"): {},
}
NOT_JSON = {("POST", "/admin/api/adapters")}
"""Multipart uploads: tests/server/test_admin_uploads.py sends them every kind of bad form."""

def _nest(leaf: Any, depth: int, as_dict: bool) -> Any:
    for _ in range(depth):
        leaf = {"k": leaf} if as_dict else [leaf]
    return leaf


SPECIAL_TEXT = ["\ud800", "a\udfffb", "\udc00\ud800", "\x00", "\u202eevil", "\ufeff", "🤖" * 50, "",
                " ", "\n" * 20, "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "x" * 5000, "../../etc/passwd", "%00", "{{7*7}}"]
SPECIAL_NUMBERS = [0, -1, -0.0, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30,
                   -(10**30), 10**400, 1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan, 0.5, -0.5]
texts = st.one_of(st.sampled_from(SPECIAL_TEXT),
                  st.text(st.characters(codec=None, exclude_categories=()), max_size=30))
numbers = st.one_of(st.sampled_from(SPECIAL_NUMBERS), st.integers(-(2**80), 2**80),
                    st.floats(allow_nan=True, allow_infinity=True))
nested = st.builds(lambda depth, leaf, as_dict: _nest(leaf, depth, as_dict),
                   st.sampled_from([2, 31, 32, 33, 60, 400]), st.one_of(texts, numbers), st.booleans())
OTHER_VALUES = [None, True, False, [], {}, [[]], {"": None}, _nest("x", 40, False), _nest(1, 40, True)]
SWEEP = SPECIAL_TEXT + SPECIAL_NUMBERS + OTHER_VALUES
hostile = st.one_of(texts, numbers, nested, st.sampled_from(OTHER_VALUES))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory, engine) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fuzz-fields")
    # Few tokens per request: generation is not what is being tested.
    with serve(RegistryConfig(data_dir=root / "data"), engine, max_tokens_limit=4) as server:
        server.registry.adapters.upload_dir("acme", "style", write_adapter(root / "style"))
        yield server


def test_no_field_value_makes_a_server_error(fuzz_server: Server) -> None:
    document = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()
    operations = {(method.upper(), path): operation for path, item in document["paths"].items()
                  for method, operation in item.items()}
    assert set(operations) - NOT_JSON == set(VALID), "every operation needs a working request in VALID"
    keys = {"admin": fuzz_server.admin_key, "tenant": fuzz_server.keys["acme"]}
    failures: list[str] = []
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as http:
        for (method, path), valid in VALID.items():
            key = keys["admin" if path.startswith("/admin") else "tenant"]
            fields = list(_fields(operations[(method, path)], document))
            start = _call(http, method, path, valid, key)  # passes validation (404 and 409 allowed)
            assert start.status_code < 500 and start.status_code != 400, (method, path, start.text)
            if not fields:
                continue
            try:
                _fuzz(http, method, path, valid, key, fields)
            except AssertionError as exc:
                failures.append(f"{method} {path}: {exc}")
    assert not failures, "\n\n".join(failures)


def _fuzz(http: httpx.Client, method: str, path: str, valid: dict, key: str,
          fields: list[tuple[str, tuple]]) -> None:
    """Every field with each of the special values, then random values in one to three fields
    at once."""
    for where, field_path in fields:
        for value in SWEEP:
            request = json.loads(json.dumps(valid))
            _set(request.setdefault(where, {}), field_path, value)
            try:
                _check_answer(_call(http, method, path, request, key))
            except AssertionError as exc:
                field = ".".join(map(str, field_path))
                raise AssertionError(f"{where} {field} = {value!r:.80}: {exc}") from None

    @given(changes=st.lists(st.tuples(st.sampled_from(fields), hostile), min_size=1, max_size=3))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    def check(changes: list[tuple[tuple[str, tuple], Any]]) -> None:
        request = json.loads(json.dumps(valid))  # a deep copy
        for (where, field_path), value in changes:
            _set(request.setdefault(where, {}), field_path, value)
        _check_answer(_call(http, method, path, request, key))

    check()


def _fields(operation: dict, document: dict) -> Iterator[tuple[str, tuple]]:
    """(where, path) of every field a client can set: `body` fields at any depth (array items
    as index 0), `path` and `query` parameters."""
    for parameter in operation.get("parameters", []):
        yield parameter["in"], (parameter["name"],)
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if schema is not None:
        yield from (("body", path) for path in dict.fromkeys(_schema_paths(schema, document, ())))


def _schema_paths(schema: dict, document: dict, path: tuple) -> Iterator[tuple]:
    if "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    if path:
        yield path
    if len(path) >= MAX_SCHEMA_DEPTH:
        return
    for option in schema.get("anyOf", []) + schema.get("oneOf", []) + schema.get("allOf", []):
        yield from _schema_paths(option, document, path)
    for name, child in schema.get("properties", {}).items():
        yield from _schema_paths(child, document, (*path, name))
    if isinstance(schema.get("items"), dict):
        yield from _schema_paths(schema["items"], document, (*path, 0))


def _set(container: Any, path: tuple, value: Any) -> None:
    """Put `value` at `path`, making (or replacing with) objects and arrays on the way."""
    *parents, last = path
    for step, following in zip(parents, (*parents[1:], last)):
        fresh: Any = [None] if isinstance(following, int) else {}
        if isinstance(step, int):
            if not isinstance(container, list) or not container:
                return  # the array is not there (a change before replaced it): nothing to set
            if not isinstance(container[0], (dict, list)):
                container[0] = fresh
            container = container[0]
        else:
            if not isinstance(container, dict):
                return
            if not isinstance(container.get(step), (dict, list)):
                container[step] = fresh
            container = container[step]
    if isinstance(last, int) and isinstance(container, list) and container:
        container[0] = value
    elif isinstance(last, str) and isinstance(container, dict):
        container[last] = value


def _call(http: httpx.Client, method: str, path: str, request: dict, key: str) -> httpx.Response:
    url = path
    for name, value in request.get("path", {}).items():
        url = url.replace(f"{{{name}}}", _url_text(value))
    query = "&".join(f"{quote(name)}={_url_text(value)}" for name, value in request.get("query", {}).items())
    headers = {"Authorization": f"Bearer {key}"}
    content = None
    if "body" in request:
        content = json.dumps(request["body"]).encode()  # NaN and Infinity as Python writes them
        headers["content-type"] = "application/json"
    try:
        return http.request(method, url + (f"?{query}" if query else ""), content=content, headers=headers)
    except httpx.TransportError as exc:
        raise AssertionError(f"the server dropped the connection ({exc!r}) on {method} {url} "
                             f"{(content or b'')[:300]!r}") from None


def _url_text(value: Any) -> str:
    """A value as a URL part: its text's UTF-8 (surrogates as their bytes) percent-encoded."""
    text = value if isinstance(value, str) else json.dumps(value)
    return quote(text.encode("utf-8", "surrogatepass"), safe="") or "%20"


def _check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    assert "x-request-id" in response.headers
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line.removeprefix("data: "))
                assert event.get("error", {}).get("type") != "server_error", line
        return
    if response.headers.get("content-type", "").startswith("application/json"):
        body = response.json()
        if response.status_code >= 400:
            assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def test_the_fuzz_reaches_every_kind_of_field(fuzz_server: Server) -> None:
    """The schema walk finds the fields that matter, nested ones included."""
    document = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()
    chat = set(_fields(document["paths"]["/v1/chat/completions"]["post"], document))
    assert {("body", ("messages", 0, "content")), ("body", ("messages", 0, "content", 0, "text")),
            ("body", ("stop", 0)), ("body", ("max_tokens",)), ("body", ("temperature",)),
            ("body", ("user",)), ("body", ("stream_options", "include_usage"))} <= chat
    audit = set(_fields(document["paths"]["/admin/api/audit"]["get"], document))
    assert audit == {("query", ("limit",)), ("query", ("before_id",)), ("query", ("object_type",))}


def test_set_puts_values_at_nested_paths() -> None:
    body: dict = {"messages": [{"role": "user", "content": "x"}]}
    _set(body, ("messages", 0, "content", 0, "text"), "\ud800")
    _set(body, ("stream_options", "include_usage"), 1e308)
    assert body == {"messages": [{"role": "user", "content": [{"text": "\ud800"}]}],
                    "stream_options": {"include_usage": 1e308}}

