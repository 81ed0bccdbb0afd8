"""Usage counters per tenant, adapter and UTC hour. Recording is one atomic
INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n, correct under concurrency on SQLite
(writers serialised by BEGIN IMMEDIATE) and PostgreSQL (row-level upsert). A write may carry an
id, stored in the same transaction: the same write again (a retry after the database's answer
was lost) then adds nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.registry.database import Database
from loraplex.registry.names import check_name
from loraplex.registry.records import UsageRecord
from loraplex.registry.registry_errors import InvalidInputError, NotFoundError
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


@dataclass(frozen=True)
class UsageEntry:
    """One tenant's and adapter's tokens (and requests) to add for the hour of `at`."""

    tenant: str
    adapter: str | None
    prompt_tokens: int
    completion_tokens: int
    num_requests: int = 1
    at: datetime | None = None
    """When (now if None): its UTC hour is the row it adds to."""


class UsageService:
    def __init__(self, db: Database) -> None:
        self._db = db

    def record(self, tenant: str, adapter: str | None, *, prompt_tokens: int,
               completion_tokens: int, num_requests: int = 1, at: datetime | None = None,
               write_id: str | None = None) -> bool:
        """Add one request's (or a batch's) tokens to the tenant's counters for the hour of
        `at` (now by default), and count the requests on the adapter. With `write_id` (unique
        to this write), a write already recorded under it adds nothing and returns False."""
        entry = UsageEntry(tenant, adapter, prompt_tokens, completion_tokens, num_requests, at)
        _check_entry(entry)
        _check_write_id(write_id)
        with self._db.write() as session:
            tenant_id = find_tenant(session, tenant).id
            if write_id is not None and not _claim(session, write_id):
                return False
            _add(session, tenant_id, entry)
        return True

    def record_many(self, entries: Sequence[UsageEntry], write_id: str | None = None) -> tuple[str, ...]:
        """Add every entry in one transaction (the usage recorder's batch: one commit for all
        the tenants and adapters whose requests finished together, not one each). The entries
        of tenants that no longer exist are skipped: their names are returned. With `write_id`,
        a write already recorded under it adds nothing (and skips nobody)."""
        for entry in entries:
            _check_entry(entry)
        _check_write_id(write_id)
        with self._db.write() as session:
            if write_id is not None and not _claim(session, write_id):
                return ()
            tenant_ids: dict[str, int | None] = {}
            for entry in entries:
                if entry.tenant not in tenant_ids:
                    try:
                        tenant_ids[entry.tenant] = find_tenant(session, entry.tenant).id
                    except NotFoundError:
                        tenant_ids[entry.tenant] = None
                tenant_id = tenant_ids[entry.tenant]
                if tenant_id is not None:
                    _add(session, tenant_id, entry)
        return tuple(sorted(tenant for tenant, tenant_id in tenant_ids.items() if tenant_id is None))

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


def _check_entry(entry: UsageEntry) -> None:
    if entry.adapter is not None:
        check_name(entry.adapter, "adapter")
    for field in _COUNTERS:
        value = getattr(entry, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInputError(f"{field} must be a non-negative integer", param=field)


def _check_write_id(write_id: str | None) -> None:
    if write_id is not None and not 0 < len(write_id) <= MAX_WRITE_ID_LENGTH:
        raise InvalidInputError(f"write_id must have 1 to {MAX_WRITE_ID_LENGTH} characters",
                                param="write_id")


def _add(session: Session, tenant_id: int, entry: UsageEntry) -> None:
    """The entry's counters into its hour's row, and its requests onto its adapter."""
    counts = {field: getattr(entry, field) for field in _COUNTERS}
    _increment(session, tenant_id, entry.adapter or BASE_MODEL, hour_of(entry.at or utcnow()), counts)
    if entry.adapter is not None and entry.num_requests:
        session.execute(
            update(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == entry.adapter)
            .values(num_requests_served=Adapter.num_requests_served + entry.num_requests)
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
