"""Tenants: create, list, get, update weight and limits, delete."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.registry.audit import record_audit
from loraplex.registry.blobs import BlobStore
from loraplex.registry.database import Database
from loraplex.registry.gc import collect_blobs
from loraplex.registry.names import check_limit, check_name, check_weight
from loraplex.registry.records import TenantRecord
from loraplex.registry.registry_errors import ConflictError, NotFoundError
from loraplex.registry.tables import Adapter, Tenant

LIMIT_FIELDS = ("max_concurrent_requests", "max_requests_per_minute", "max_tokens_per_minute")


class _Unchanged:
    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Any = _Unchanged()
"""Default of TenantService.update's arguments: leave the field as it is (None means
unlimited)."""


def find_tenant(session: Session, name: str) -> Tenant:
    """The tenant row named `name`, or NotFoundError."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFoundError(f"tenant {name!r} does not exist", param="tenant")
    return tenant


class TenantService:
    def __init__(self, db: Database, blobs: BlobStore) -> None:
        self._db = db
        self._blobs = blobs

    def create(
        self, name: str, *, weight: float = 1.0, max_concurrent_requests: int | None = None,
        max_requests_per_minute: int | None = None, max_tokens_per_minute: int | None = None,
        actor: int | None = None,
    ) -> TenantRecord:
        check_name(name, "tenant")
        values = {"weight": check_weight(weight)} | _limits({
            "max_concurrent_requests": max_concurrent_requests,
            "max_requests_per_minute": max_requests_per_minute,
            "max_tokens_per_minute": max_tokens_per_minute,
        })
        try:
            with self._db.write() as session:
                if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
                    raise ConflictError(f"tenant {name!r} already exists", param="name")
                tenant = Tenant(name=name, **values)
                session.add(tenant)
                session.flush()
                record_audit(session, actor, "tenant.create", "tenant", name, values)
                return tenant_record(tenant)
        except IntegrityError:
            raise ConflictError(f"tenant {name!r} already exists", param="name") from None

    def list(self) -> tuple[TenantRecord, ...]:
        with self._db.read() as session:
            rows = session.scalars(select(Tenant).order_by(Tenant.name))
            return tuple(tenant_record(row) for row in rows)

    def get(self, name: str) -> TenantRecord:
        with self._db.read() as session:
            return tenant_record(find_tenant(session, name))

    def update(
        self, name: str, *, weight: float = UNCHANGED,
        max_concurrent_requests: int | None = UNCHANGED,
        max_requests_per_minute: int | None = UNCHANGED,
        max_tokens_per_minute: int | None = UNCHANGED, actor: int | None = None,
    ) -> TenantRecord:
        """Change the weight and/or limits; arguments left UNCHANGED keep their value."""
        changes = _limits({
            "max_concurrent_requests": max_concurrent_requests,
            "max_requests_per_minute": max_requests_per_minute,
            "max_tokens_per_minute": max_tokens_per_minute,
        })
        if weight is not UNCHANGED:
            changes["weight"] = check_weight(weight)
        with self._db.write() as session:
            tenant = find_tenant(session, name)
            before = {field: getattr(tenant, field) for field in changes}
            for field, value in changes.items():
                setattr(tenant, field, value)
            session.flush()
            if changes:
                record_audit(session, actor, "tenant.update", "tenant", name,
                             {"before": before, "after": changes})
            return tenant_record(tenant)

    def delete(self, name: str, *, actor: int | None = None) -> None:
        """Delete the tenant with its keys, adapters, system prompts and usage; blobs no other
        adapter uses are removed."""
        with self._db.write() as session:
            tenant = find_tenant(session, name)
            rows = session.execute(
                select(Adapter.weights_sha256, Adapter.config_sha256)
                .where(Adapter.tenant_id == tenant.id)
            ).all()
            session.delete(tenant)
            session.flush()
            record_audit(session, actor, "tenant.delete", "tenant", name,
                         {"num_adapters": len(rows)})
        collect_blobs(self._db, self._blobs, {digest for row in rows for digest in row})


def tenant_record(row: Tenant) -> TenantRecord:
    return TenantRecord(
        id=row.id, name=row.name, weight=row.weight,
        max_concurrent_requests=row.max_concurrent_requests,
        max_requests_per_minute=row.max_requests_per_minute,
        max_tokens_per_minute=row.max_tokens_per_minute, created_at=row.created_at,
    )


def _limits(values: dict[str, Any]) -> dict[str, Any]:
    return {field: check_limit(value, field) for field, value in values.items()
            if value is not UNCHANGED}
