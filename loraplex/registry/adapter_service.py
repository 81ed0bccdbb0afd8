"""Adapters: upload (validated against the served base model, stored as two content-addressed
blobs, then one row), list, get, delete. On any failure of an upload nothing is stored."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.adapter_format import (
    CONFIG_NAME,
    MAX_CONFIG_BYTES,
    WEIGHTS_NAME,
    LoraAdapter,
    find_adapter_files,
    load_adapter,
)
from loraplex.errors import AdapterError
from loraplex.registry.audit import record_audit
from loraplex.registry.blobs import BlobStore, StagedBlob
from loraplex.registry.database import Database
from loraplex.registry.gc import collect_blobs, collect_blobs_quietly
from loraplex.registry.model_service import ServedModelService
from loraplex.registry.names import check_name
from loraplex.registry.records import AdapterRecord, ServedModelRecord
from loraplex.registry.registry_errors import AdapterNotFoundError, ConflictError
from loraplex.registry.tables import Adapter, Tenant
from loraplex.registry.tenant_service import find_tenant


def find_adapter(session: Session, tenant_id: int, tenant: str, name: str) -> Adapter:
    """The tenant's adapter row named `name`, or AdapterNotFoundError."""
    row = session.scalar(select(Adapter).where(Adapter.tenant_id == tenant_id,
                                               Adapter.name == name))
    if row is None:
        raise AdapterNotFoundError(f"tenant {tenant!r} has no adapter named {name!r}",
                                   param="model")
    return row


class AdapterService:
    def __init__(self, db: Database, blobs: BlobStore, models: ServedModelService,
                 max_upload_bytes: int) -> None:
        self._db = db
        self._blobs = blobs
        self._models = models
        self._max_upload_bytes = max_upload_bytes

    def upload(
        self, tenant: str, name: str, config: bytes, weights: str | Path | BinaryIO, *,
        model: ServedModelRecord | None = None, actor: int | None = None,
    ) -> AdapterRecord:
        """Validate and store an adapter: `config` is adapter_config.json's bytes, `weights`
        the path of adapter_model.safetensors or a binary stream of it (read once, in chunks).
        Checked against `model`, by default the served model recorded in the registry.
        Raises AdapterError, InvalidInputError, NotFoundError, ConflictError or
        BaseModelUnknownError; then nothing is stored."""
        check_name(name, "adapter")
        if len(config) > MAX_CONFIG_BYTES:
            raise AdapterError(f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes")
        served = model or self._models.require()
        if isinstance(weights, str):
            weights = Path(weights)
        with self._db.read() as session:
            _check_name_free(session, find_tenant(session, tenant), name)
        staged: list[StagedBlob] = []
        try:
            staged.append(self._blobs.stage(config, MAX_CONFIG_BYTES, CONFIG_NAME))
            staged.append(self._blobs.stage(weights, self._max_upload_bytes, WEIGHTS_NAME))
            adapter = load_adapter(config, staged[1].path, served.shape, served.max_lora_rank)
            return self._commit(tenant, name, adapter, staged[0], staged[1], served, actor)
        finally:
            for blob in staged:
                self._blobs.discard(blob)

    def upload_dir(
        self, tenant: str, name: str, folder: str | Path, *,
        model: ServedModelRecord | None = None, actor: int | None = None,
    ) -> AdapterRecord:
        """upload() from a PEFT adapter folder (adapter_config.json and
        adapter_model.safetensors; a folder with only a pickle file is refused)."""
        check_name(name, "adapter")
        config_path, weights_path = find_adapter_files(folder)
        return self.upload(tenant, name, config_path.read_bytes(), weights_path, model=model,
                           actor=actor)

    def list(self, tenant: str | None = None) -> tuple[AdapterRecord, ...]:
        """Adapters of one tenant, or of all, by tenant and name."""
        query = (select(Adapter, Tenant.name).join(Tenant, Adapter.tenant_id == Tenant.id)
                 .order_by(Tenant.name, Adapter.name))
        with self._db.read() as session:
            if tenant is not None:
                query = query.where(Adapter.tenant_id == find_tenant(session, tenant).id)
            return tuple(self._record(row, owner) for row, owner in session.execute(query))

    def names_by_digest(self, digests: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """`tenant/name` of every adapter with each of these digests (identities), sorted; a
        digest no adapter has maps to ()."""
        wanted = set(digests)
        names: dict[str, list[str]] = {digest: [] for digest in wanted}
        if wanted:
            query = (select(Adapter.digest, Tenant.name, Adapter.name)
                     .join(Tenant, Adapter.tenant_id == Tenant.id).where(Adapter.digest.in_(wanted)))
            with self._db.read() as session:
                for digest, tenant, name in session.execute(query):
                    names[digest].append(f"{tenant}/{name}")
        return {digest: tuple(sorted(found)) for digest, found in names.items()}

    def get(self, tenant: str, name: str) -> AdapterRecord:
        """The tenant's adapter `name` with its blob paths (what the engine loads);
        AdapterNotFoundError (code model_not_found) if the tenant has none of that name."""
        with self._db.read() as session:
            tenant_row = find_tenant(session, tenant)
            return self._record(find_adapter(session, tenant_row.id, tenant, name), tenant)

    def delete(self, tenant: str, name: str, *, actor: int | None = None) -> None:
        """Delete the adapter (and system prompts bound to it); its blobs go once no other
        adapter uses them."""
        with self._db.write() as session:
            tenant_row = find_tenant(session, tenant)
            row = find_adapter(session, tenant_row.id, tenant, name)
            digests = {row.weights_sha256, row.config_sha256}
            record_audit(session, actor, "adapter.delete", "adapter", f"{tenant}/{name}",
                         {"digest": row.digest})
            session.delete(row)
        collect_blobs(self._db, self._blobs, digests)

    def _commit(
        self, tenant: str, name: str, adapter: LoraAdapter, config: StagedBlob,
        weights: StagedBlob, served: ServedModelRecord, actor: int | None,
    ) -> AdapterRecord:
        published: set[str] = set()
        try:
            with self._db.write() as session:
                self._db.lock_blobs(session)
                tenant_row = find_tenant(session, tenant)
                _check_name_free(session, tenant_row, name)
                for blob in (config, weights):
                    self._blobs.publish(blob)
                    published.add(blob.sha256)
                row = Adapter(
                    tenant_id=tenant_row.id, name=name, digest=adapter.digest,
                    weights_sha256=weights.sha256, config_sha256=config.sha256,
                    base_model=served.model_id, family=adapter.family, rank=adapter.rank,
                    alpha=adapter.config.alpha,
                    target_modules=list(adapter.target_modules), size_bytes=weights.size,
                )
                session.add(row)
                session.flush()
                record_audit(session, actor, "adapter.upload", "adapter", f"{tenant}/{name}",
                             {"digest": adapter.digest, "family": adapter.family, "rank": adapter.rank,
                              "size_bytes": weights.size})
                return self._record(row, tenant)
        except IntegrityError:
            collect_blobs_quietly(self._db, self._blobs, published)
            raise ConflictError(f"tenant {tenant!r} already has an adapter named {name!r}",
                                param="name") from None
        except BaseException:
            collect_blobs_quietly(self._db, self._blobs, published)
            raise

    def _record(self, row: Adapter, tenant: str) -> AdapterRecord:
        return AdapterRecord(
            id=row.id, tenant=tenant, name=row.name, digest=row.digest,
            weights_sha256=row.weights_sha256, config_sha256=row.config_sha256,
            weights_path=self._blobs.path(row.weights_sha256),
            config_path=self._blobs.path(row.config_sha256), base_model=row.base_model,
            rank=row.rank, alpha=row.alpha, target_modules=tuple(row.target_modules),
            size_bytes=row.size_bytes, created_at=row.created_at,
            num_requests_served=row.num_requests_served, family=row.family,
        )


def _check_name_free(session: Session, tenant: Tenant, name: str) -> None:
    taken = session.scalar(select(Adapter.id).where(Adapter.tenant_id == tenant.id,
                                                    Adapter.name == name))
    if taken is not None:
        raise ConflictError(f"tenant {tenant.name!r} already has an adapter named {name!r}",
                            param="name")
