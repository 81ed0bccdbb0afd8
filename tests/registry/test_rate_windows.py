"""The replicas' rate windows on SQLite and PostgreSQL: counts add up per replica and slot,
each replica reads the others' (never its own), requests in flight come from each replica's
latest fresh row, old rows go, and a deleted tenant's counts are dropped."""

from __future__ import annotations

from sqlalchemy import select

from loraplex.registry import Registry
from loraplex.registry.tables import RateWindow


def _exchange(registry: Registry, replica: str, counts, in_flight, now_slot: int = 1000):
    return registry.rate_windows.exchange(replica, counts, in_flight, now_slot=now_slot,
                                          window_slots=61, stale_slots=10)


def test_each_replica_reads_the_others_sums(registry: Registry) -> None:
    acme = registry.tenants.get("acme").id
    assert _exchange(registry, "a", {(acme, 998): (2, 30), (acme, 1000): (1, 10)}, {acme: 3}) == {}
    assert _exchange(registry, "a", {(acme, 998): (0, -5)}, {acme: 2}) == {}  # a reservation returned
    _exchange(registry, "c", {(acme, 1000): (4, 40)}, {acme: 1}, now_slot=985)  # stale in-flight
    remote = _exchange(registry, "b", {(acme, 1000): (5, 50)}, {acme: 7})[acme]
    assert [(s.slot, s.num_requests, s.num_tokens) for s in remote.slots] == [(998, 2, 25), (1000, 5, 50)]
    assert remote.num_in_flight == 2
    remote = _exchange(registry, "a", {}, {})[acme]
    assert [(s.slot, s.num_requests, s.num_tokens) for s in remote.slots] == [(1000, 9, 90)]
    assert remote.num_in_flight == 7


def test_old_slots_go_and_deleted_tenants_are_skipped(registry: Registry) -> None:
    acme = registry.tenants.get("acme").id
    registry.tenants.create("gone")
    gone = registry.tenants.get("gone").id
    _exchange(registry, "a", {(acme, 900): (1, 1), (gone, 1000): (1, 1)}, {})
    registry.tenants.delete("gone")
    _exchange(registry, "a", {(gone, 1000): (1, 1)}, {gone: 1}, now_slot=1000)
    assert _exchange(registry, "b", {}, {}, now_slot=1000) == {}  # 900 is out of the window
    assert _slots(registry) == [900]
    _exchange(registry, "b", {}, {}, now_slot=1100)
    assert _slots(registry) == []


def _slots(registry: Registry) -> list[int]:
    with registry.db.read() as session:
        return list(session.scalars(select(RateWindow.slot)))
