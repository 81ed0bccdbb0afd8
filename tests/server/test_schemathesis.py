"""Schemathesis against the live server's /openapi.json: every operation (OpenAI and admin
routes, with valid keys) gets generated valid and invalid requests; none may produce a 5xx, and
responses must match what the document declares. Fixed seed, bounded examples."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from loraplex.registry import RegistryConfig
from tests.registry.registry_support import PostgresSchema, postgres_server_url, write_adapter
from tests.server.server_support import MODEL_ID, Server, serve

MAX_EXAMPLES = 20


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def fuzzed_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  engine) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fuzz")
    with contextlib.ExitStack() as stack:
        url = None
        if request.param == "postgresql":
            server_url = postgres_server_url()
            if server_url is None:
                pytest.skip("no PostgreSQL server on 127.0.0.1:5432")
            schema = PostgresSchema(server_url, f"lpx_fuzz_{secrets.token_hex(6)}")
            schema.create()
            stack.callback(schema.drop)
            url = schema.url
        # Few tokens per request: generation is not what is being tested.
        server = stack.enter_context(serve(RegistryConfig(data_dir=root / "data", database_url=url), engine,
                                           max_tokens_limit=8))
        server.registry.adapters.upload_dir("acme", "style", write_adapter(root / "style"))
        yield server


def _steer(drawn: tuple[schemathesis.Case, bool]) -> schemathesis.Case:
    """Most cases name things that exist (the base model, adapter `style` of tenant acme), so
    that generated requests get past the lookups and reach the engine and the registry."""
    case, keep_generated_names = drawn
    if keep_generated_names or case.method == "DELETE":
        return case
    if isinstance(case.body, dict):
        for field, value in (("model", "style" if "prompt" in case.body else MODEL_ID),
                             ("tenant", "acme")):
            if isinstance(case.body.get(field), str):
                case.body[field] = value
        if "prompt" in case.body:
            case.body["prompt"] = "a prompt"  # generated token ids are mostly outside the vocabulary
    for field, value in (("model", "style"), ("tenant", "acme"), ("name", "style")):
        if isinstance((case.path_parameters or {}).get(field), str):
            case.path_parameters[field] = "acme" if case.path.startswith("/admin/api/tenants") else value
    return case


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def test_api_has_no_server_errors(fuzzed_server: Server) -> None:
    """(Schemathesis' pytest plugin does not run under this pytest: the operations are driven
    through Hypothesis here, one bounded, derandomized run per operation and mode.)"""
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    registry = fuzzed_server.registry
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=st.tuples(operation.as_strategy(generation_mode=mode), st.booleans()).map(_steer))
            @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            def check(case: schemathesis.Case) -> None:
                # Fresh keys each time: a generated call may revoke a key or delete a tenant.
                admin = case.path.startswith("/admin")
                key = registry.keys.create(admin=admin, tenant=None if admin else "acme").secret
                case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, checks=CHECKS)

            try:
                check()
            except Unsatisfiable:  # no invalid request exists (no parameters, no body)
                continue
            except BaseException as exc:  # schemathesis' FailureGroup is a BaseExceptionGroup
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)
