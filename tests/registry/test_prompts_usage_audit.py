"""System prompts, usage counters and the audit log."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from loraplex.registry import Registry
from loraplex.registry.registry_errors import (
    AdapterNotFoundError,
    ConflictError,
    InvalidInputError,
    NotFoundError,
)
from loraplex.registry.usage_service import UsageEntry
from tests.registry.registry_support import write_adapter


def test_system_prompts(registry: Registry, tmp_path: Path) -> None:
    adapter = registry.adapters.upload_dir("acme", "sql", write_adapter(tmp_path / "a"))
    plain = registry.prompts.add("acme", "plain", "You are terse.")
    bound = registry.prompts.add("acme", "sql-helper", "You write SQL.", adapter="sql", actor=2)
    assert (plain.adapter, plain.adapter_digest) == (None, None)
    assert (bound.adapter, bound.adapter_digest) == ("sql", adapter.digest)
    assert registry.prompts.get("acme", "sql-helper") == bound
    assert [p.name for p in registry.prompts.list("acme")] == ["plain", "sql-helper"]
    with pytest.raises(ConflictError):
        registry.prompts.add("acme", "plain", "again")
    with pytest.raises(AdapterNotFoundError):
        registry.prompts.add("acme", "x", "text", adapter="missing")
    with pytest.raises(InvalidInputError, match="empty"):
        registry.prompts.add("acme", "x", "  \n")
    with pytest.raises(InvalidInputError, match="longer than"):
        registry.prompts.add("acme", "x", "y" * 200_001)
    with pytest.raises(InvalidInputError, match="invalid system prompt name"):
        registry.prompts.add("acme", "a b", "text")
    for bad, reason in (("a\ud800b", "lone surrogate at character 1"), ("a\x00b", "NUL character at 1")):
        with pytest.raises(InvalidInputError, match=reason) as caught:  # what no database stores
            registry.prompts.add("acme", "x", bad)
        assert caught.value.param == "text"
    registry.adapters.delete("acme", "sql")  # a prompt bound to it goes with it
    assert [p.name for p in registry.prompts.list()] == ["plain"]
    registry.prompts.delete("acme", "plain")
    with pytest.raises(NotFoundError, match="no system prompt named 'plain'"):
        registry.prompts.get("acme", "plain")
    with pytest.raises(NotFoundError):
        registry.prompts.delete("acme", "plain")


def test_a_usage_write_done_again_under_its_id_adds_nothing(registry: Registry) -> None:
    """A retry of a write whose answer was lost (tests/server/test_registry_outage.py cuts the
    connection after the COMMIT for real) carries the same id, and counts once."""
    assert registry.usage.record("acme", None, prompt_tokens=5, completion_tokens=7, num_requests=3,
                                 write_id="a1")
    assert not registry.usage.record("acme", None, prompt_tokens=5, completion_tokens=7, num_requests=3,
                                     write_id="a1")
    assert registry.usage.record("acme", None, prompt_tokens=1, completion_tokens=1, write_id="a2")
    [row] = registry.usage.query(tenant="acme")
    assert (row.num_requests, row.prompt_tokens, row.completion_tokens) == (4, 6, 8)
    with pytest.raises(InvalidInputError):
        registry.usage.record("acme", None, prompt_tokens=1, completion_tokens=1, write_id="x" * 33)


def test_a_batch_of_usage_is_one_write_that_skips_deleted_tenants(registry: Registry, tmp_path: Path) -> None:
    """The usage recorder's batch: every tenant's and adapter's entry in one transaction under one
    write id; a tenant deleted meanwhile is skipped and named; the same write again adds nothing."""
    registry.adapters.upload_dir("acme", "sql", write_adapter(tmp_path / "a"))
    registry.tenants.create("beta")
    nine = datetime(2025, 3, 1, 9, 15, tzinfo=timezone.utc)
    entries = [UsageEntry("acme", "sql", 10, 5, 2, nine), UsageEntry("acme", None, 7, 1, 1, nine),
               UsageEntry("ghost", None, 3, 3, 1, nine), UsageEntry("beta", None, 100, 1, 4, nine)]
    assert registry.usage.record_many(entries, write_id="b1") == ("ghost",)
    assert registry.usage.record_many(entries, write_id="b1") == ()  # a retry: nothing added
    rows = registry.usage.query(since=nine)
    assert sorted(((r.tenant, r.adapter, r.num_requests, r.prompt_tokens, r.completion_tokens)
                   for r in rows), key=str) == [("acme", "sql", 2, 10, 5), ("acme", None, 1, 7, 1),
                                                ("beta", None, 4, 100, 1)]
    assert registry.adapters.get("acme", "sql").num_requests_served == 2
    with pytest.raises(InvalidInputError, match="prompt_tokens"):  # refused whole, before writing
        registry.usage.record_many([UsageEntry("beta", None, 1, 1), UsageEntry("acme", None, -1, 1)])
    assert sum(r.num_requests for r in registry.usage.query(tenant="beta")) == 4


def test_usage_adds_up_per_tenant_adapter_and_hour(registry: Registry, tmp_path: Path) -> None:
    registry.adapters.upload_dir("acme", "sql", write_adapter(tmp_path / "a"))
    registry.tenants.create("beta")
    nine = datetime(2025, 3, 1, 9, 15, tzinfo=timezone.utc)
    ten = nine + timedelta(hours=1)
    registry.usage.record("acme", "sql", prompt_tokens=10, completion_tokens=5, at=nine)
    registry.usage.record("acme", "sql", prompt_tokens=1, completion_tokens=2, at=nine +
                          timedelta(minutes=40))
    registry.usage.record("acme", None, prompt_tokens=7, completion_tokens=0, at=nine)
    registry.usage.record("acme", "sql", prompt_tokens=3, completion_tokens=3, at=ten)
    registry.usage.record("beta", None, prompt_tokens=100, completion_tokens=1, num_requests=4,
                          at=ten)
    rows = registry.usage.query(tenant="acme")
    assert [(r.hour.hour, r.adapter, r.num_requests, r.prompt_tokens, r.completion_tokens)
            for r in rows] == [(9, None, 1, 7, 0), (9, "sql", 2, 11, 7), (10, "sql", 1, 3, 3)]
    assert rows[0].hour == nine.replace(minute=0)
    assert [r.tenant for r in registry.usage.query(since=ten)] == ["acme", "beta"]
    assert len(registry.usage.query(until=ten.replace(minute=0))) == 2
    assert len(registry.usage.query(until=ten)) == 4  # hours overlapping [since, until)
    assert len(registry.usage.query(adapter="sql")) == 2
    assert registry.adapters.get("acme", "sql").num_requests_served == 3
    with pytest.raises(InvalidInputError):
        registry.usage.record("acme", None, prompt_tokens=-1, completion_tokens=0)
    with pytest.raises(NotFoundError):
        registry.usage.record("nobody", None, prompt_tokens=1, completion_tokens=0)


def test_audit_log_records_admin_actions_in_order(registry: Registry, tmp_path: Path) -> None:
    key = registry.keys.create(admin=True)
    registry.tenants.create("beta", actor=key.key.id)
    registry.adapters.upload_dir("beta", "x", write_adapter(tmp_path / "a"), actor=key.key.id)
    registry.keys.revoke(key.key.id, actor=key.key.id)
    entries = registry.audit.list()
    assert [e.action for e in entries][:4] == ["key.revoke", "adapter.upload", "tenant.create",
                                               "key.create"]
    assert entries[0].actor_key_id == key.key.id
    assert [e.action for e in registry.audit.list(object_type="tenant")] == ["tenant.create",
                                                                             "tenant.create"]
    page = registry.audit.list(limit=2)
    assert [e.id for e in registry.audit.list(limit=2, before_id=page[-1].id)] == [
        e.id for e in entries[2:4]]


def test_a_failed_change_leaves_no_audit_entry(registry: Registry) -> None:
    before = registry.audit.list()
    with pytest.raises(ConflictError):
        registry.tenants.create("acme")
    assert registry.audit.list() == before


def test_audit_entries_cannot_be_changed(registry: Registry) -> None:
    with pytest.raises(DBAPIError, match="append-only"), registry.db.write() as session:
        session.execute(text("DELETE FROM audit_log"))
    assert registry.audit.list()  # the served model and tenant entries are still there
