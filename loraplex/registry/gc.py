"""Keeping the blob store and the adapter rows consistent: removing blobs no row refers to and
reconciling after a crash. Every step that removes a blob holds the blob lock (Database.
lock_blobs), which uploads also hold while they publish a blob and insert its row, so a blob is
never removed between an upload's rename and its commit."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

from sqlalchemy import select

from loraplex.registry.blobs import BlobStore
from loraplex.registry.database import Database
from loraplex.registry.records import MissingBlob, ReconcileReport
from loraplex.registry.tables import Adapter, Tenant

log = logging.getLogger(__name__)


def collect_blobs(db: Database, blobs: BlobStore, candidates: Iterable[str]) -> list[str]:
    """Remove those of `candidates` that no adapter refers to; returns the removed ones."""
    candidates = set(candidates)
    if not candidates:
        return []
    removed = []
    with db.write() as session:
        db.lock_blobs(session)
        referenced = set(session.scalars(
            select(Adapter.weights_sha256).where(Adapter.weights_sha256.in_(candidates))
        )) | set(session.scalars(
            select(Adapter.config_sha256).where(Adapter.config_sha256.in_(candidates))
        ))
        for digest in sorted(candidates - referenced):
            if blobs.remove(digest):
                removed.append(digest)
    return removed


def collect_blobs_quietly(db: Database, blobs: BlobStore, candidates: Iterable[str]) -> None:
    """collect_blobs after a failed upload: a failure here is logged, not raised, so it does
    not hide the original error (reconcile() finishes the job)."""
    try:
        collect_blobs(db, blobs, candidates)
    except Exception:
        log.warning("could not remove the blobs of a failed upload", exc_info=True)


def reconcile(db: Database, blobs: BlobStore, max_temp_age_s: float) -> ReconcileReport:
    """Remove stale temporary files and orphan blobs; report adapters whose blobs are gone."""
    temps = []
    for path in blobs.stale_temps(max_temp_age_s):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            temps.append(path)
    removed, missing = [], []
    with db.write() as session:
        db.lock_blobs(session)
        rows = session.execute(
            select(Tenant.name, Adapter.name, Adapter.weights_sha256, Adapter.config_sha256)
            .join(Tenant, Adapter.tenant_id == Tenant.id).order_by(Tenant.name, Adapter.name)
        ).all()
        referenced = {digest for row in rows for digest in row[2:]}
        for digest in blobs.digests():
            if digest not in referenced and blobs.remove(digest):
                removed.append(digest)
        for tenant, name, *digests in rows:
            missing.extend(MissingBlob(tenant, name, d) for d in digests if not blobs.exists(d))
    for item in missing:
        log.warning("adapter %s/%s: blob %s is missing", item.tenant, item.adapter, item.digest)
    return ReconcileReport(tuple(removed), tuple(temps), tuple(missing))
