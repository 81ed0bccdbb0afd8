"""Named system prompts per tenant, optionally bound to one of the tenant's adapters (the
engine shares their KV cache per (adapter digest, prompt tokens))."""

from __future__ import annotations

from sqlalchemy import Select, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.registry.adapter_service import find_adapter
from loraplex.registry.audit import record_audit
from loraplex.registry.database import Database
from loraplex.registry.names import check_name, check_text
from loraplex.registry.records import SystemPromptRecord
from loraplex.registry.registry_errors import ConflictError, InvalidInputError, NotFoundError
from loraplex.registry.tables import Adapter, SystemPrompt, Tenant
from loraplex.registry.tenant_service import find_tenant

MAX_PROMPT_CHARS = 200_000


class PromptService:
    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, tenant: str, name: str, text: str, *, adapter: str | None = None,
            actor: int | None = None) -> SystemPromptRecord:
        check_name(name, "system prompt")
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError("the system prompt text is empty", param="text")
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidInputError(f"the system prompt is longer than {MAX_PROMPT_CHARS} "
                                    f"characters", param="text")
        check_text(text, "the system prompt", "text")
        conflict = ConflictError(f"tenant {tenant!r} already has a system prompt named "
                                 f"{name!r}", param="name")
        try:
            with self._db.write() as session:
                tenant_row = find_tenant(session, tenant)
                adapter_id = (find_adapter(session, tenant_row.id, tenant, adapter).id
                              if adapter is not None else None)
                if session.scalar(select(SystemPrompt.id).where(
                        SystemPrompt.tenant_id == tenant_row.id, SystemPrompt.name == name)):
                    raise conflict
                row = SystemPrompt(tenant_id=tenant_row.id, name=name, adapter_id=adapter_id,
                                   text=text)
                session.add(row)
                session.flush()
                record_audit(session, actor, "prompt.add", "system_prompt", f"{tenant}/{name}",
                             {"adapter": adapter, "num_chars": len(text)})
                return _one(session, _query().where(SystemPrompt.id == row.id))
        except IntegrityError:
            raise conflict from None

    def list(self, tenant: str | None = None) -> tuple[SystemPromptRecord, ...]:
        query = _query().order_by(Tenant.name, SystemPrompt.name)
        with self._db.read() as session:
            if tenant is not None:
                query = query.where(SystemPrompt.tenant_id == find_tenant(session, tenant).id)
            return tuple(_record(*row) for row in session.execute(query))

    def get(self, tenant: str, name: str) -> SystemPromptRecord:
        with self._db.read() as session:
            tenant_row = find_tenant(session, tenant)
            return _one(session, _query().where(SystemPrompt.tenant_id == tenant_row.id,
                                                SystemPrompt.name == name), tenant, name)

    def delete(self, tenant: str, name: str, *, actor: int | None = None) -> None:
        with self._db.write() as session:
            tenant_row = find_tenant(session, tenant)
            row = session.scalar(select(SystemPrompt).where(
                SystemPrompt.tenant_id == tenant_row.id, SystemPrompt.name == name))
            if row is None:
                raise _not_found(tenant, name)
            session.delete(row)
            record_audit(session, actor, "prompt.delete", "system_prompt", f"{tenant}/{name}")


def _query() -> Select[tuple[SystemPrompt, str, str | None, str | None]]:
    return (select(SystemPrompt, Tenant.name, Adapter.name, Adapter.digest)
            .join(Tenant, SystemPrompt.tenant_id == Tenant.id)
            .outerjoin(Adapter, SystemPrompt.adapter_id == Adapter.id))


def _one(session: Session, query: Select[tuple[SystemPrompt, str, str | None, str | None]],
         tenant: str = "", name: str = "") -> SystemPromptRecord:
    row = session.execute(query).first()
    if row is None:
        raise _not_found(tenant, name)
    return _record(*row)


def _not_found(tenant: str, name: str) -> NotFoundError:
    return NotFoundError(f"tenant {tenant!r} has no system prompt named {name!r}", param="name")


def _record(row: SystemPrompt, tenant: str, adapter: str | None,
            digest: str | None) -> SystemPromptRecord:
    return SystemPromptRecord(id=row.id, tenant=tenant, name=row.name, adapter=adapter,
                              adapter_digest=digest, text=row.text, created_at=row.created_at)
