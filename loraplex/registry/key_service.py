"""API keys. A key is `lpx-` and 43 url-safe characters (256 random bits); only its sha256 is
stored, with a short prefix for telling keys apart. A presented key is hashed and looked up by
its hash (a unique index), then compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import or_, select, update

from loraplex.registry.audit import record_audit
from loraplex.registry.database import Database
from loraplex.registry.records import CreatedKey, KeyRecord, Principal, Role
from loraplex.registry.registry_errors import (
    AuthenticationError,
    InvalidInputError,
    NotFoundError,
    RegistryUnavailableError,
    StorageFullError,
)
from loraplex.registry.tables import ApiKey, Tenant, utcnow
from loraplex.registry.tenant_service import find_tenant

log = logging.getLogger(__name__)

KEY_PREFIX = "lpx-"
PREFIX_LENGTH = 12
MAX_PRESENTED_KEY_LENGTH = 256
LAST_USED_RESOLUTION = timedelta(seconds=60)
"""last_used_at is written at most this often per key, so that checking keys stays a read."""


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyService:
    def __init__(self, db: Database) -> None:
        self._db = db

    def create(self, *, tenant: str | None = None, admin: bool = False,
               actor: int | None = None) -> CreatedKey:
        """A new key for `tenant`, or an admin key; the secret is returned only here."""
        if admin == (tenant is not None):
            raise InvalidInputError("a key belongs either to one tenant or is an admin key",
                                    param="tenant")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        with self._db.write() as session:
            tenant_id = find_tenant(session, tenant).id if tenant is not None else None
            key = ApiKey(role="admin" if admin else "tenant", tenant_id=tenant_id,
                         secret_hash=hash_secret(secret), prefix=secret[:PREFIX_LENGTH])
            session.add(key)
            session.flush()
            record_audit(session, actor, "key.create", "api_key", str(key.id),
                         {"role": key.role, "tenant": tenant, "prefix": key.prefix})
            return CreatedKey(_record(key, tenant), secret)

    def list(self, *, tenant: str | None = None) -> tuple[KeyRecord, ...]:
        query = (select(ApiKey, Tenant.name).outerjoin(Tenant, ApiKey.tenant_id == Tenant.id)
                 .order_by(ApiKey.id))
        with self._db.read() as session:
            if tenant is not None:
                query = query.where(ApiKey.tenant_id == find_tenant(session, tenant).id)
            return tuple(_record(key, name) for key, name in session.execute(query))

    def revoke(self, key_id: int, *, actor: int | None = None) -> KeyRecord:
        """Revoke a key; revoking a revoked key changes nothing."""
        with self._db.write() as session:
            row = session.execute(
                select(ApiKey, Tenant.name).outerjoin(Tenant, ApiKey.tenant_id == Tenant.id)
                .where(ApiKey.id == key_id)
            ).first()
            if row is None:
                raise NotFoundError(f"API key {key_id} does not exist", param="key_id")
            key, tenant = row
            if key.revoked_at is None:
                key.revoked_at = utcnow()
                session.flush()
                record_audit(session, actor, "key.revoke", "api_key", str(key.id),
                             {"role": key.role, "tenant": tenant, "prefix": key.prefix})
            return _record(key, tenant)

    def authenticate(self, presented: str) -> Principal:
        """Who `presented` speaks for; AuthenticationError if it is unknown or revoked."""
        if not isinstance(presented, str) or not 0 < len(presented) <= MAX_PRESENTED_KEY_LENGTH:
            raise AuthenticationError("invalid API key")
        digest = hash_secret(presented)
        with self._db.read() as session:
            row = session.execute(
                select(ApiKey, Tenant.name).outerjoin(Tenant, ApiKey.tenant_id == Tenant.id)
                .where(ApiKey.secret_hash == digest)
            ).first()
        if row is None or not hmac.compare_digest(row[0].secret_hash, digest):
            raise AuthenticationError("invalid API key")
        key, tenant = row
        if key.revoked_at is not None:
            raise AuthenticationError("this API key has been revoked")
        now = utcnow()
        if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
            try:
                self._touch(key.id, now)
            except (RegistryUnavailableError, StorageFullError) as exc:  # it can be read, not written
                log.warning("last use of API key %d not recorded: %s", key.id, exc.message)
        return Principal(key_id=key.id, role=cast(Role, key.role), tenant_id=key.tenant_id,
                         tenant=tenant)

    def _touch(self, key_id: int, now: datetime) -> None:
        stale = now - LAST_USED_RESOLUTION
        with self._db.write() as session:
            session.execute(
                update(ApiKey).where(ApiKey.id == key_id)
                .where(or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < stale))
                .values(last_used_at=now)
            )


def _record(key: ApiKey, tenant: str | None) -> KeyRecord:
    return KeyRecord(id=key.id, role=cast(Role, key.role), tenant=tenant,
                     prefix=key.prefix, created_at=key.created_at, revoked_at=key.revoked_at,
                     last_used_at=key.last_used_at)
