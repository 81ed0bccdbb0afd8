"""Plain, immutable records that the service layer returns (never live ORM objects, so callers
cannot lazy-load or write through them outside a transaction)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from loraplex.adapter_format import BaseModelShape

Role = Literal["admin", "tenant"]


@dataclass(frozen=True)
class TenantRecord:
    id: int
    name: str
    weight: float
    max_concurrent_requests: int | None
    """None means unlimited, as for the two limits below."""
    max_requests_per_minute: int | None
    max_tokens_per_minute: int | None
    created_at: datetime


@dataclass(frozen=True)
class KeyRecord:
    """An API key as listed: never its secret, never its hash."""

    id: int
    role: Role
    tenant: str | None
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class CreatedKey:
    """A new key. `secret` is shown this once and stored nowhere."""

    key: KeyRecord
    secret: str


@dataclass(frozen=True)
class Principal:
    """Who a presented API key speaks for."""

    key_id: int
    role: Role
    tenant_id: int | None
    tenant: str | None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


@dataclass(frozen=True)
class AdapterRecord:
    id: int
    tenant: str
    name: str
    digest: str
    """The adapter's identity: LoraAdapter.digest (sha256 of canonical tensors)."""
    weights_sha256: str
    config_sha256: str
    weights_path: Path
    """adapter_model.safetensors in the blob store; pass with config_path's bytes to
    loraplex.adapter_format.load_adapter."""
    config_path: Path
    base_model: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int
    created_at: datetime
    num_requests_served: int
    family: str = "lora"
    """lora, dora, ia3 or flora."""


@dataclass(frozen=True)
class SystemPromptRecord:
    id: int
    tenant: str
    name: str
    adapter: str | None
    adapter_digest: str | None
    """The digest of `adapter`, for prefix-group keys; None for the base model."""
    text: str
    created_at: datetime


@dataclass(frozen=True)
class DocumentRecord:
    id: int
    tenant: str
    name: str
    text: str
    created_at: datetime


@dataclass(frozen=True)
class UsageRecord:
    tenant: str
    adapter: str | None
    """None for requests to the base model."""
    hour: datetime
    num_requests: int
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class AuditRecord:
    id: int
    actor_key_id: int | None
    action: str
    object_type: str
    object_id: str
    details: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class ServedModelRecord:
    """The base model uploads are validated against."""

    model_id: str
    shape: BaseModelShape
    max_lora_rank: int
    updated_at: datetime | None = None


@dataclass(frozen=True)
class MissingBlob:
    tenant: str
    adapter: str
    digest: str
    """The sha256 of the missing weights or config blob."""


@dataclass(frozen=True)
class ReconcileReport:
    removed_blobs: tuple[str, ...]
    """Blobs no adapter referred to (left by an interrupted upload or delete)."""
    removed_temp_files: tuple[Path, ...]
    missing_blobs: tuple[MissingBlob, ...]
    """Adapters whose blobs are gone; reported, not repaired."""

    @property
    def is_consistent(self) -> bool:
        return not self.missing_blobs
