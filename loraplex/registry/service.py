"""The registry: one object that owns the database, the blob store and the services over them.
Callers (server, CLI) go through it; they never run SQL. Every service method is one
transaction and raises the typed errors of loraplex.registry.registry_errors (or AdapterError).

    registry = Registry.open(RegistryConfig.resolve())
    registry.tenants.create("acme")
    secret = registry.keys.create(tenant="acme").secret
    registry.adapters.upload_dir("acme", "sql-expert", "/path/to/peft-adapter")
"""

from __future__ import annotations

from sqlalchemy.exc import OperationalError

from loraplex.registry.adapter_service import AdapterService
from loraplex.registry.audit import AuditService
from loraplex.registry.blobs import BlobStore
from loraplex.registry.database import Database, display_url, make_engine
from loraplex.registry.document_service import DocumentService
from loraplex.registry.gc import reconcile
from loraplex.registry.key_service import KeyService
from loraplex.registry.migrate import current_revision, ensure_schema, head_revision
from loraplex.registry.model_service import ServedModelService
from loraplex.registry.prompt_service import PromptService
from loraplex.registry.rate_windows import RateWindowService
from loraplex.registry.records import ReconcileReport
from loraplex.registry.registry_config import RegistryConfig
from loraplex.registry.registry_errors import RegistryError
from loraplex.registry.tenant_service import TenantService
from loraplex.registry.usage_service import UsageService


class Registry:
    """Tenants, keys, adapters, system prompts, usage, audit log, the served model record and the
    replicas' rate windows. Thread-safe: each call opens its own session and transaction."""

    def __init__(self, config: RegistryConfig, db: Database, blobs: BlobStore) -> None:
        self.config = config
        self.db = db
        self.blobs = blobs
        self.models = ServedModelService(db)
        self.tenants = TenantService(db, blobs)
        self.keys = KeyService(db)
        self.adapters = AdapterService(db, blobs, self.models, config.max_upload_bytes)
        self.prompts = PromptService(db)
        self.documents = DocumentService(db)
        self.usage = UsageService(db)
        self.audit = AuditService(db)
        self.rate_windows = RateWindowService(db)

    @classmethod
    def open(cls, config: RegistryConfig, *, migrate: bool = True) -> Registry:
        """Open (creating the data dir and, with `migrate`, the schema as needed). Without
        `migrate` a database not at the current schema is refused."""
        config.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        engine = make_engine(config.url, busy_timeout_s=config.busy_timeout_s,
                             connect_timeout_s=config.connect_timeout_s)
        try:
            if migrate:
                ensure_schema(engine)
            elif current_revision(engine) != head_revision():
                raise RegistryError("the registry database schema is not current; run "
                                    "`loraplex db upgrade`")
        except OperationalError as exc:
            engine.dispose()
            reason = str(exc.orig or exc).strip().splitlines()[0]
            raise RegistryError(f"cannot open the registry database "
                                f"{display_url(config.url)}: {reason}") from None
        except BaseException:
            engine.dispose()
            raise
        blobs = BlobStore(config.blob_dir)
        blobs.create_dirs()
        return cls(config, Database(engine), blobs)

    def reconcile(self) -> ReconcileReport:
        """Make the blob store agree with the database after a crash: remove temporary files
        of dead uploads and blobs no adapter refers to; report adapters whose blobs are
        missing. Run on start; safe while other processes use the registry."""
        return reconcile(self.db, self.blobs, self.config.max_temp_age_s)

    def close(self) -> None:
        self.db.dispose()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
