"""API keys: shown once, stored only as a sha256, resolved by hash, revocable."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select

from loraplex.registry import Registry
from loraplex.registry.registry_errors import AuthenticationError, InvalidInputError, NotFoundError
from loraplex.registry.tables import ApiKey


def _stored(registry: Registry) -> list[ApiKey]:
    with registry.db.read() as session:
        return list(session.scalars(select(ApiKey)))


def test_secrets_are_never_stored_in_clear(registry: Registry) -> None:
    created = registry.keys.create(tenant="acme")
    secret = created.secret
    assert secret.startswith("lpx-") and len(secret) >= 40
    (row,) = _stored(registry)
    assert row.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert row.prefix == secret[:12]
    stored_text = " ".join(str(getattr(row, c.key)) for c in ApiKey.__table__.columns)
    assert secret not in stored_text and secret[12:] not in stored_text
    assert all(secret not in repr(key) for key in registry.keys.list())


def test_authenticate_resolves_role_and_tenant(registry: Registry) -> None:
    tenant_key = registry.keys.create(tenant="acme")
    admin_key = registry.keys.create(admin=True, actor=None)
    principal = registry.keys.authenticate(tenant_key.secret)
    assert (principal.role, principal.tenant, principal.key_id) == ("tenant", "acme",
                                                                    tenant_key.key.id)
    assert not principal.is_admin
    admin = registry.keys.authenticate(admin_key.secret)
    assert admin.is_admin and admin.tenant is None
    last_used = {key.id: key.last_used_at for key in registry.keys.list()}
    assert all(value is not None for value in last_used.values())


@pytest.mark.parametrize("presented", ["", "lpx-wrong", "x" * 10_000, "Bearer lpx-"])
def test_unknown_keys_are_refused(registry: Registry, presented: str) -> None:
    registry.keys.create(tenant="acme")
    with pytest.raises(AuthenticationError, match="invalid API key"):
        registry.keys.authenticate(presented)


def test_revoked_keys_are_refused(registry: Registry) -> None:
    created = registry.keys.create(tenant="acme")
    other = registry.keys.create(tenant="acme")
    revoked = registry.keys.revoke(created.key.id, actor=1)
    assert revoked.is_revoked
    assert registry.keys.revoke(created.key.id).revoked_at == revoked.revoked_at  # no-op
    with pytest.raises(AuthenticationError, match="revoked"):
        registry.keys.authenticate(created.secret)
    assert registry.keys.authenticate(other.secret).tenant == "acme"
    revokes = [e for e in registry.audit.list() if e.action == "key.revoke"]
    assert len(revokes) == 1 and revokes[0].object_id == str(created.key.id)
    with pytest.raises(NotFoundError):
        registry.keys.revoke(9999)


def test_a_key_is_for_one_tenant_or_admin(registry: Registry) -> None:
    with pytest.raises(InvalidInputError):
        registry.keys.create()
    with pytest.raises(InvalidInputError):
        registry.keys.create(tenant="acme", admin=True)
    with pytest.raises(NotFoundError):
        registry.keys.create(tenant="nobody")


def test_list_filters_by_tenant(registry: Registry) -> None:
    registry.tenants.create("beta")
    registry.keys.create(tenant="acme")
    registry.keys.create(tenant="beta")
    registry.keys.create(admin=True)
    assert [k.tenant for k in registry.keys.list()] == ["acme", "beta", None]
    assert [k.tenant for k in registry.keys.list(tenant="beta")] == ["beta"]
