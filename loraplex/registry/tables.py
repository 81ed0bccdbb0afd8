"""The registry schema as SQLAlchemy 2 typed ORM classes. migrations/ creates the same tables
(tests/registry/test_migrations.py checks that they agree). Times are stored as naive UTC and
read back as aware UTC datetimes on both SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
DIGEST_LENGTH = 64
NAME_LENGTH = 64


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime, stored naive (same text on SQLite, same value on
    PostgreSQL, so it can sit in a primary key)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("registry times must be timezone-aware")
        return value.astimezone(timezone.utc).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=timezone.utc)


_Json = JSON().with_variant(JSONB(), "postgresql")
_BigId = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER only


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: _Json}


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint("weight > 0", name="weight_positive"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1"))
    """Share of the engine under contention (virtual token counters divide by it)."""
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    """None means unlimited, as for the two limits below."""
    max_requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint(
            "(role = 'admin' AND tenant_id IS NULL) OR (role = 'tenant' AND tenant_id IS NOT NULL)",
            name="role_matches_tenant",
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    tenant_id: Mapped[int | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    secret_hash: Mapped[str] = mapped_column(String(DIGEST_LENGTH), unique=True)
    """sha256 hex of the secret; the secret itself is never stored."""
    prefix: Mapped[str] = mapped_column(String(16))
    """The first characters of the secret, for telling keys apart in listings."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()
    last_used_at: Mapped[datetime | None] = mapped_column()


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    digest: Mapped[str] = mapped_column(String(DIGEST_LENGTH), index=True)
    """LoraAdapter.digest: sha256 of the canonical tensors and scalings; the identity."""
    weights_sha256: Mapped[str] = mapped_column(String(DIGEST_LENGTH), index=True)
    config_sha256: Mapped[str] = mapped_column(String(DIGEST_LENGTH), index=True)
    base_model: Mapped[str] = mapped_column(String(255))
    family: Mapped[str] = mapped_column(String(16), default="lora", server_default="lora")
    """lora, dora, ia3 or flora (loraplex.adapter_format.FAMILIES)."""
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(_Json)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    num_requests_served: Mapped[int] = mapped_column(
        BigInteger, default=0, server_default=text("0")
    )


class SystemPrompt(Base):
    __tablename__ = "system_prompts"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    adapter_id: Mapped[int | None] = mapped_column(
        ForeignKey("adapters.id", ondelete="CASCADE"), index=True
    )
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Document(Base):
    """A tenant's registered document: requests name it to include its text, and the engine
    reuses its KV wherever it lands in a prompt (CacheBlend)."""

    __tablename__ = "documents"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Usage(Base):
    """Counters per tenant, adapter ('' for the base model) and UTC hour, only ever
    incremented (INSERT ... ON CONFLICT DO UPDATE)."""

    __tablename__ = "usage"

    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    adapter: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    hour: Mapped[datetime] = mapped_column(primary_key=True)
    num_requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


class UsageWrite(Base):
    """The id of each usage write that carried one, inserted in the write's own transaction: a
    write retried after its answer was lost finds its id and adds nothing. Kept for
    `loraplex.registry.usage_service.WRITE_IDS_KEPT`."""

    __tablename__ = "usage_writes"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    written_at: Mapped[datetime] = mapped_column(index=True)


class AuditEntry(Base):
    """Append-only (database triggers refuse UPDATE and DELETE); written in the same
    transaction as the change it records."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True)
    actor_key_id: Mapped[int | None] = mapped_column(Integer)
    """The admin key that made the change; None for the local operator (CLI) or the server."""
    action: Mapped[str] = mapped_column(String(64))
    object_type: Mapped[str] = mapped_column(String(32))
    object_id: Mapped[str] = mapped_column(String(160))
    details: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class ServedModel(Base):
    """The one base model that `loraplex serve` serves (a single row, id 1), so that uploads
    can be validated without loading it."""

    __tablename__ = "served_model"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    model_id: Mapped[str] = mapped_column(String(255))
    num_layers: Mapped[int] = mapped_column(Integer)
    hidden_size: Mapped[int] = mapped_column(Integer)
    intermediate_size: Mapped[int] = mapped_column(Integer)
    num_heads: Mapped[int] = mapped_column(Integer)
    num_kv_heads: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    max_lora_rank: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class RateWindow(Base):
    """Each replica's admissions per tenant and time slot (whole seconds since the epoch,
    `loraplex.registry.rate_windows.SLOT_S` long), only ever incremented; with the requests it
    had in flight when it last wrote the slot. Replicas that share a database add up each
    other's rows to enforce tenant limits together (loraplex.server.shared_limits)."""

    __tablename__ = "rate_windows"

    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    replica: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    slot: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False, index=True)
    num_requests: Mapped[int] = mapped_column(BigInteger)
    num_tokens: Mapped[int] = mapped_column(BigInteger)
    num_in_flight: Mapped[int] = mapped_column(Integer)
