"""The append-only audit log of admin actions. `record_audit` adds an entry inside the caller's
transaction, so the entry commits or rolls back with the change it describes."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.registry.database import Database
from loraplex.registry.records import AuditRecord
from loraplex.registry.tables import AuditEntry


def record_audit(
    session: Session, actor: int | None, action: str, object_type: str, object_id: str,
    details: dict[str, Any] | None = None,
) -> None:
    """Add an audit entry to the current transaction. `actor` is the admin key id, None for
    the local operator."""
    session.add(AuditEntry(actor_key_id=actor, action=action, object_type=object_type,
                           object_id=object_id, details=details or {}))


class AuditService:
    def __init__(self, db: Database) -> None:
        self._db = db

    def list(self, *, limit: int = 100, before_id: int | None = None,
             object_type: str | None = None) -> tuple[AuditRecord, ...]:
        """Newest entries first; page with `before_id` (the last id of the previous page)."""
        query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(max(1, min(limit, 1000)))
        if before_id is not None:
            query = query.where(AuditEntry.id < before_id)
        if object_type is not None:
            query = query.where(AuditEntry.object_type == object_type)
        with self._db.read() as session:
            return tuple(_record(row) for row in session.scalars(query))


def _record(row: AuditEntry) -> AuditRecord:
    return AuditRecord(id=row.id, actor_key_id=row.actor_key_id, action=row.action,
                       object_type=row.object_type, object_id=row.object_id,
                       details=dict(row.details), created_at=row.created_at)
