"""Named documents per tenant (issue 25): a request names them to include their text, and the
engine computes each one's KV once per (tenant, adapter digest) and reuses it wherever the
document lands in a prompt (CacheBlend)."""

from __future__ import annotations

from sqlalchemy import Select, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.registry.audit import record_audit
from loraplex.registry.database import Database
from loraplex.registry.names import check_name, check_text
from loraplex.registry.records import DocumentRecord
from loraplex.registry.registry_errors import ConflictError, InvalidInputError, NotFoundError
from loraplex.registry.tables import Document, Tenant
from loraplex.registry.tenant_service import find_tenant

MAX_DOCUMENT_CHARS = 200_000


class DocumentService:
    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, tenant: str, name: str, text: str, *, actor: int | None = None) -> DocumentRecord:
        check_name(name, "document")
        check_document_text(text)
        conflict = ConflictError(f"tenant {tenant!r} already has a document named {name!r}", param="name")
        try:
            with self._db.write() as session:
                tenant_row = find_tenant(session, tenant)
                if session.scalar(select(Document.id).where(
                        Document.tenant_id == tenant_row.id, Document.name == name)):
                    raise conflict
                row = Document(tenant_id=tenant_row.id, name=name, text=text)
                session.add(row)
                session.flush()
                record_audit(session, actor, "document.add", "document", f"{tenant}/{name}",
                             {"num_chars": len(text)})
                return _one(session, _query().where(Document.id == row.id))
        except IntegrityError:
            raise conflict from None

    def list(self, tenant: str | None = None) -> tuple[DocumentRecord, ...]:
        query = _query().order_by(Tenant.name, Document.name)
        with self._db.read() as session:
            if tenant is not None:
                query = query.where(Document.tenant_id == find_tenant(session, tenant).id)
            return tuple(_record(*row) for row in session.execute(query))

    def ids(self, tenant: str) -> tuple[int, ...]:
        """The ids of the tenant's documents (a cheap read: no text). Documents are never edited,
        so an id names one text for good."""
        with self._db.read() as session:
            tenant_id = find_tenant(session, tenant).id
            return tuple(session.scalars(select(Document.id).where(Document.tenant_id == tenant_id)
                                         .order_by(Document.id)))

    def get(self, tenant: str, name: str) -> DocumentRecord:
        with self._db.read() as session:
            tenant_row = find_tenant(session, tenant)
            return _one(session, _query().where(Document.tenant_id == tenant_row.id,
                                                Document.name == name), tenant, name)

    def get_many(self, tenant: str, names: list[str]) -> tuple[DocumentRecord, ...]:
        """The tenant's documents `names`, in that order (NotFoundError naming the first unknown)."""
        with self._db.read() as session:
            tenant_row = find_tenant(session, tenant)
            found = {row[0].name: _record(*row) for row in session.execute(
                _query().where(Document.tenant_id == tenant_row.id, Document.name.in_(set(names))))}
        for name in names:
            if name not in found:
                raise _not_found(tenant, name)
        return tuple(found[name] for name in names)

    def delete(self, tenant: str, name: str, *, actor: int | None = None) -> None:
        with self._db.write() as session:
            tenant_row = find_tenant(session, tenant)
            row = session.scalar(select(Document).where(
                Document.tenant_id == tenant_row.id, Document.name == name))
            if row is None:
                raise _not_found(tenant, name)
            session.delete(row)
            record_audit(session, actor, "document.delete", "document", f"{tenant}/{name}")


def check_document_text(text: object) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError("the document is empty", param="text")
    if len(text) > MAX_DOCUMENT_CHARS:
        raise InvalidInputError(f"the document has {len(text)} characters; at most {MAX_DOCUMENT_CHARS} "
                                "are allowed", param="text")
    return check_text(text, "the document", "text")


def _query() -> Select[tuple[Document, str]]:
    return select(Document, Tenant.name).join(Tenant, Document.tenant_id == Tenant.id)


def _one(session: Session, query: Select[tuple[Document, str]], tenant: str = "",
         name: str = "") -> DocumentRecord:
    row = session.execute(query).first()
    if row is None:
        raise _not_found(tenant, name)
    return _record(*row)


def _not_found(tenant: str, name: str) -> NotFoundError:
    return NotFoundError(f"tenant {tenant!r} has no document named {name!r}", param="documents")


def _record(row: Document, tenant: str) -> DocumentRecord:
    return DocumentRecord(id=row.id, tenant=tenant, name=row.name, text=row.text, created_at=row.created_at)
