"""Tenants: create, list, get, update weight and limits, delete (cascading), audit entries."""

from __future__ import annotations

import pytest

from loraplex.registry import Registry
from loraplex.registry.registry_errors import ConflictError, InvalidInputError, NotFoundError
from tests.registry.registry_support import write_adapter


def test_create_list_get(registry: Registry) -> None:
    created = registry.tenants.create("beta", weight=2.5, max_concurrent_requests=4,
                                      max_tokens_per_minute=1000)
    assert created.weight == 2.5 and created.max_concurrent_requests == 4
    assert created.max_requests_per_minute is None  # unlimited
    assert created.created_at.tzinfo is not None
    assert [t.name for t in registry.tenants.list()] == ["acme", "beta"]
    assert registry.tenants.get("beta") == created
    assert registry.tenants.get("acme").weight == 1.0


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "has space"}, "invalid tenant name"),
    ({"name": "x" * 65}, "invalid tenant name"),
    ({"name": ".."}, "invalid tenant name"),
    ({"name": "ok", "weight": 0}, "weight must be"),
    ({"name": "ok", "weight": float("inf")}, "weight must be"),
    ({"name": "ok", "max_concurrent_requests": 0}, "max_concurrent_requests"),
    ({"name": "ok", "max_tokens_per_minute": 1.5}, "max_tokens_per_minute"),
])
def test_invalid_tenants_are_refused(registry: Registry, kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        registry.tenants.create(**kwargs)
    assert [t.name for t in registry.tenants.list()] == ["acme"]


def test_duplicate_tenant_is_a_conflict(registry: Registry) -> None:
    with pytest.raises(ConflictError, match="'acme' already exists"):
        registry.tenants.create("acme")


def test_update_changes_only_what_is_given(registry: Registry) -> None:
    registry.tenants.update("acme", max_requests_per_minute=60, actor=7)
    updated = registry.tenants.update("acme", weight=3)
    assert (updated.weight, updated.max_requests_per_minute) == (3.0, 60)
    cleared = registry.tenants.update("acme", max_requests_per_minute=None)
    assert cleared.max_requests_per_minute is None and cleared.weight == 3.0
    entry = [e for e in registry.audit.list() if e.action == "tenant.update"][-1]
    assert entry.actor_key_id == 7
    assert entry.details == {"before": {"max_requests_per_minute": None},
                             "after": {"max_requests_per_minute": 60}}
    with pytest.raises(InvalidInputError):
        registry.tenants.update("acme", weight=-1)
    with pytest.raises(NotFoundError, match="'nobody' does not exist"):
        registry.tenants.update("nobody", weight=2)


def test_delete_removes_keys_adapters_prompts_usage_and_unshared_blobs(
    registry: Registry, tmp_path
) -> None:
    registry.tenants.create("beta")
    folder = write_adapter(tmp_path / "a")
    registry.adapters.upload_dir("acme", "one", folder)
    registry.adapters.upload_dir("beta", "same-bytes", folder)
    secret = registry.keys.create(tenant="acme").secret
    registry.prompts.add("acme", "greeting", "You are helpful.", adapter="one")
    registry.usage.record("acme", "one", prompt_tokens=3, completion_tokens=4)
    blobs = sorted(registry.blobs.digests())
    registry.tenants.delete("acme")
    with pytest.raises(NotFoundError):
        registry.tenants.get("acme")
    assert [(a.tenant, a.name) for a in registry.adapters.list()] == [("beta", "same-bytes")]
    assert registry.keys.list() == () and registry.prompts.list() == ()
    assert registry.usage.query() == ()
    assert sorted(registry.blobs.digests()) == blobs  # still used by beta
    with pytest.raises(Exception, match="invalid API key"):
        registry.keys.authenticate(secret)
    registry.tenants.delete("beta")
    assert list(registry.blobs.digests()) == []
    actions = [e.action for e in registry.audit.list()]
    assert actions[:2] == ["tenant.delete", "tenant.delete"]
