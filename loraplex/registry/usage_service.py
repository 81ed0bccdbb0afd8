"""Usage counters per tenant, adapter and UTC hour. Recording is one atomic
INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n, correct under concurrency on SQLite
(writers serialised by BEGIN IMMEDIATE) and PostgreSQL (row-level upsert). A write may carry an
id, stored in the same transaction: the same write again (a retry after the database's answer
was lost) then adds nothing."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.registry.database import Database
from loraplex.registry.names import check_name
from loraplex.registry.records import UsageRecord
from loraplex.registry.registry_errors import InvalidInputError
from loraplex.registry.tables import Adapter, Tenant, Usage, UsageWrite, utcnow
from loraplex.registry.tenant_service import find_tenant

BASE_MODEL = ""
"""The `adapter` column's value for requests to the base model."""
_COUNTERS = ("num_requests", "prompt_tokens", "completion_tokens")
WRITE_IDS_KEPT = timedelta(days=7)
"""How long a write's id is remembered: a retry later than that would count again."""
MAX_WRITE_ID_LENGTH = 32


def hour_of(at: datetime) -> datetime:
    """The start of the UTC hour holding `at` (an aware datetime)."""
    if at.tzinfo is None:
        raise InvalidInputError("usage times must be timezone-aware")
    return at.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


class UsageService:
    def __init__(self, db: Database) -> None:
        self._db = db

    def record(self, tenant: str, adapter: str | None, *, prompt_tokens: int,
               completion_tokens: int, num_requests: int = 1, at: datetime | None = None,
               write_id: str | None = None) -> bool:
        """Add one request's (or a batch's) tokens to the tenant's counters for the hour of
        `at` (now by default), and count the requests on the adapter. With `write_id` (unique
        to this write), a write already recorded under it adds nothing and returns False."""
        if adapter is not None:
            check_name(adapter, "adapter")
        counts = {"num_requests": num_requests, "prompt_tokens": prompt_tokens,
                  "completion_tokens": completion_tokens}
        for field, value in counts.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(f"{field} must be a non-negative integer", param=field)
        if write_id is not None and not 0 < len(write_id) <= MAX_WRITE_ID_LENGTH:
            raise InvalidInputError(f"write_id must have 1 to {MAX_WRITE_ID_LENGTH} characters",
                                    param="write_id")
        hour = hour_of(at or utcnow())
        with self._db.write() as session:
            tenant_id = find_tenant(session, tenant).id
            if write_id is not None and not _claim(session, write_id):
                return False
            _increment(session, tenant_id, adapter or BASE_MODEL, hour, counts)
            if adapter is not None and num_requests:
                session.execute(
                    update(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == adapter)
                    .values(num_requests_served=Adapter.num_requests_served + num_requests)
                )
        return True

    def query(self, *, tenant: str | None = None, adapter: str | None = None,
              since: datetime | None = None, until: datetime | None = None
              ) -> tuple[UsageRecord, ...]:
        """Hourly rows of the hours that overlap [since, until), by hour, tenant and adapter.
        `adapter` None means every adapter and the base model."""
        query = (select(Usage, Tenant.name).join(Tenant, Usage.tenant_id == Tenant.id)
                 .order_by(Usage.hour, Tenant.name, Usage.adapter))
        if adapter is not None:
            query = query.where(Usage.adapter == adapter)
        if since is not None:
            query = query.where(Usage.hour >= hour_of(since))
        if until is not None:
            query = query.where(Usage.hour < until)
        with self._db.read() as session:
            if tenant is not None:
                query = query.where(Usage.tenant_id == find_tenant(session, tenant).id)
            return tuple(
                UsageRecord(tenant=name, adapter=row.adapter or None, hour=row.hour,
                            num_requests=row.num_requests, prompt_tokens=row.prompt_tokens,
                            completion_tokens=row.completion_tokens)
                for row, name in session.execute(query)
            )


def _increment(session: Session, tenant_id: int, adapter: str, hour: datetime,
               counts: dict[str, int]) -> None:
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    statement = dialect.insert(Usage).values(tenant_id=tenant_id, adapter=adapter, hour=hour,
                                             **counts)
    columns = Usage.__table__.c
    statement = statement.on_conflict_do_update(
        index_elements=[columns.tenant_id, columns.adapter, columns.hour],
        set_={field: columns[field] + statement.excluded[field] for field in _COUNTERS},
    )
    session.execute(statement)


def _claim(session: Session, write_id: str) -> bool:
    """Store the write's id; False if it is there already (the write was done). Ids older than
    WRITE_IDS_KEPT go."""
    now = utcnow()
    session.execute(delete(UsageWrite).where(UsageWrite.written_at < now - WRITE_IDS_KEPT))
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    inserted = session.execute(dialect.insert(UsageWrite).values(id=write_id, written_at=now)
                               .on_conflict_do_nothing(index_elements=[UsageWrite.__table__.c.id])
                               .returning(UsageWrite.id))
    return inserted.first() is not None
