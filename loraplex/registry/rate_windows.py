"""Tenant load shared by the replicas of one database: each replica adds what it admitted to its
own rows (requests and tokens per tenant and one-second slot, one atomic
INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n each) and reads back the sums of the
others' rows, all in one transaction (`exchange`), so that tenant limits hold across replicas.
Rows older than the window are deleted by whoever exchanges next."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import and_, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loraplex.registry.database import Database
from loraplex.registry.tables import RateWindow, Tenant

SLOT_S = 1
"""Length of a slot in seconds: slot = int(unix time) // SLOT_S."""


@dataclass(frozen=True)
class SlotLoad:
    slot: int
    num_requests: int
    num_tokens: int


@dataclass(frozen=True)
class RemoteLoad:
    """One tenant's load on the other replicas."""

    slots: tuple[SlotLoad, ...]
    """Requests and tokens admitted in each slot of the window, oldest first."""
    num_in_flight: int
    """Requests in flight, as each other replica last wrote (stale replicas left out)."""


class RateWindowService:
    def __init__(self, db: Database) -> None:
        self._db = db

    def exchange(self, replica: str, counts: Mapping[tuple[int, int], tuple[int, int]],
                 in_flight: Mapping[int, int], *, now_slot: int, window_slots: int,
                 stale_slots: int) -> dict[int, RemoteLoad]:
        """Add `counts` ((tenant id, slot) -> (requests, tokens), either may be negative: a
        reservation returned) to `replica`'s rows, record its requests in flight per tenant id at
        `now_slot`, and return the other replicas' load by tenant id: their slots after
        `now_slot - window_slots`, and their requests in flight from rows written since
        `now_slot - stale_slots`. Tenants deleted meanwhile are skipped."""
        with self._db.write() as session:
            tenant_ids = {tenant_id for tenant_id, _ in counts} | set(in_flight)
            live = set(session.scalars(select(Tenant.id).where(Tenant.id.in_(tenant_ids)))) \
                if tenant_ids else set()
            rows = {key: [*value, None] for key, value in counts.items() if key[0] in live}
            for tenant_id, num in in_flight.items():
                if tenant_id in live:
                    rows.setdefault((tenant_id, now_slot), [0, 0, None])[2] = num
            _upsert(session, replica, rows)
            session.execute(delete(RateWindow).where(RateWindow.slot <= now_slot - 2 * window_slots))
            return _remote(session, replica, now_slot - window_slots, now_slot - stale_slots)


def _upsert(session: Session, replica: str, rows: dict[tuple[int, int], list]) -> None:
    """Counters only ever add up; `num_in_flight` is replaced where given."""
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    columns = RateWindow.__table__.c
    for keep_in_flight in (True, False):
        values = [dict(tenant_id=tenant_id, replica=replica, slot=slot, num_requests=num_requests,
                       num_tokens=num_tokens, num_in_flight=num_in_flight or 0)
                  for (tenant_id, slot), (num_requests, num_tokens, num_in_flight) in sorted(rows.items())
                  if (num_in_flight is None) == keep_in_flight]
        if not values:
            continue
        statement = dialect.insert(RateWindow).values(values)
        changes = {name: columns[name] + statement.excluded[name] for name in ("num_requests", "num_tokens")}
        if not keep_in_flight:
            changes["num_in_flight"] = statement.excluded.num_in_flight
        session.execute(statement.on_conflict_do_update(
            index_elements=[columns.tenant_id, columns.replica, columns.slot], set_=changes))


def _remote(session: Session, replica: str, after_slot: int, fresh_slot: int) -> dict[int, RemoteLoad]:
    others = RateWindow.replica != replica
    slots: dict[int, list[SlotLoad]] = {}
    for tenant_id, slot, num_requests, num_tokens in session.execute(
            select(RateWindow.tenant_id, RateWindow.slot, func.sum(RateWindow.num_requests),
                   func.sum(RateWindow.num_tokens))
            .where(others, RateWindow.slot > after_slot)
            .group_by(RateWindow.tenant_id, RateWindow.slot).order_by(RateWindow.slot)):
        if not num_requests and not num_tokens:  # a row written for requests in flight only
            continue
        slots.setdefault(tenant_id, []).append(SlotLoad(slot, int(num_requests), int(num_tokens)))
    latest = (select(RateWindow.tenant_id, RateWindow.replica, func.max(RateWindow.slot).label("slot"))
              .where(others, RateWindow.slot >= fresh_slot)
              .group_by(RateWindow.tenant_id, RateWindow.replica).subquery())
    in_flight = dict(session.execute(
        select(RateWindow.tenant_id, func.sum(RateWindow.num_in_flight))
        .join(latest, and_(RateWindow.tenant_id == latest.c.tenant_id,
                           RateWindow.replica == latest.c.replica, RateWindow.slot == latest.c.slot))
        .group_by(RateWindow.tenant_id)).all())
    return {tenant_id: RemoteLoad(tuple(slots.get(tenant_id, ())), int(in_flight.get(tenant_id, 0)))
            for tenant_id in slots.keys() | in_flight.keys()}
