"""Bodies of the admin API (/admin/api). Responses never carry server paths, key hashes or
secrets (except a new key's secret, once)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from loraplex.engine.tenants import MAX_WEIGHT, MIN_WEIGHT
from loraplex.registry.records import (
    AdapterRecord,
    AuditRecord,
    DocumentRecord,
    KeyRecord,
    SystemPromptRecord,
    TenantRecord,
    UsageRecord,
)
from loraplex.server.schemas.client_body import ClientBody

NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="1 to 64 of A-Z a-z 0-9 . _ -")]
IDENTITY = ("The sha256 of its canonical tensors (each tensor's name, dtype, shape and bytes, in name "
            "order) and of the scaling of each module: the same digest in the admin API, the UI, the "
            "CLI and the engine. Uploads with the same tensors and scaling are one adapter to the "
            "engine (one copy, one device slot), whatever their files' bytes or names.")
Limit = Annotated[int | None, Field(ge=1, lt=2**31, description="A positive integer; null means "
                                    "unlimited.")]


class Body(ClientBody):
    """A request body: unknown fields and text that is not valid Unicode are refused."""


# Tenants ---------------------------------------------------------------------------------------
class TenantCreate(Body):
    name: Name
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT, description="Share of the engine under "
                          "contention, relative to other tenants' (service: prompt tokens + 2 x "
                          "generated tokens, over the weight).")
    max_concurrent_requests: Limit = None
    max_requests_per_minute: Limit = None
    max_tokens_per_minute: Limit = None


class TenantUpdate(Body):
    """Fields left out keep their value; a limit set to null becomes unlimited."""

    weight: float | None = Field(None, ge=MIN_WEIGHT, le=MAX_WEIGHT, description="Share of the engine under "
                                 "contention; applies from the engine's next step.")
    max_concurrent_requests: Limit = None
    max_requests_per_minute: Limit = None
    max_tokens_per_minute: Limit = None


class Tenant(BaseModel):
    name: str
    weight: float
    max_concurrent_requests: int | None
    max_requests_per_minute: int | None
    max_tokens_per_minute: int | None
    created_at: datetime
    requests_in_flight: int = Field(description="This server's requests of the tenant now.")

    @classmethod
    def of(cls, record: TenantRecord, in_flight: int) -> Tenant:
        return cls(name=record.name, weight=record.weight,
                   max_concurrent_requests=record.max_concurrent_requests,
                   max_requests_per_minute=record.max_requests_per_minute,
                   max_tokens_per_minute=record.max_tokens_per_minute, created_at=record.created_at,
                   requests_in_flight=in_flight)


# Keys ------------------------------------------------------------------------------------------
class KeyCreate(Body):
    """Either `tenant` (a tenant's key) or `admin: true` (an admin key)."""

    tenant: str | None = Field(None, pattern=NAME_PATTERN)
    admin: bool = False


class ApiKey(BaseModel):
    id: int
    role: Literal["admin", "tenant"]
    tenant: str | None
    prefix: str = Field(description="The first characters of the key, to tell keys apart.")
    created_at: datetime
    last_used_at: datetime | None = Field(description="When the key was last used, as recorded: at most "
                                          "once a minute per key, so up to a minute behind.")
    revoked_at: datetime | None
    is_revoked: bool

    @classmethod
    def of(cls, record: KeyRecord) -> ApiKey:
        return cls(id=record.id, role=record.role, tenant=record.tenant, prefix=record.prefix,
                   created_at=record.created_at, last_used_at=record.last_used_at,
                   revoked_at=record.revoked_at, is_revoked=record.is_revoked)


class CreatedApiKey(BaseModel):
    key: ApiKey
    secret: str = Field(description="The key itself: shown this once, stored nowhere.")


# Adapters --------------------------------------------------------------------------------------
class Adapter(BaseModel):
    tenant: str
    name: str
    digest: str = Field(description=f"The adapter's identity. {IDENTITY}")
    base_model: str
    family: str = Field(description="lora, dora (PEFT use_dora), ia3 (PEFT IA3) or flora "
                                    "(multiplicative, docs/flora-format.md).")
    rank: int = Field(description="The largest rank of its modules (0 for IA3).")
    alpha: float
    target_modules: list[str]
    size_bytes: int
    created_at: datetime
    num_requests_served: int
    is_loaded: bool = Field(description="In the engine's host tier now.")
    is_resident: bool = Field(description="In a device slot now.")
    device_bytes: int = Field(0, description="Device memory it takes now (its slot's pages of the "
                              "pool that the KV cache shares); 0 when not resident.")

    @classmethod
    def of(cls, record: AdapterRecord, loaded: set[str], device_bytes: dict[str, int]) -> Adapter:
        return cls(tenant=record.tenant, name=record.name, digest=record.digest,
                   base_model=record.base_model, family=record.family, rank=record.rank,
                   alpha=record.alpha,
                   target_modules=list(record.target_modules), size_bytes=record.size_bytes,
                   created_at=record.created_at, num_requests_served=record.num_requests_served,
                   is_loaded=record.digest in loaded, is_resident=record.digest in device_bytes,
                   device_bytes=device_bytes.get(record.digest, 0))


# System prompts --------------------------------------------------------------------------------
class PromptCreate(Body):
    tenant: Name
    name: Name
    text: str = Field(min_length=1, max_length=200_000, pattern=r"^[^\x00]*$",
                      description="The prompt (no NUL characters).")
    adapter: str | None = Field(None, pattern=NAME_PATTERN,
                                description="Bind the prompt to one of the tenant's adapters.")


class SystemPrompt(BaseModel):
    tenant: str
    name: str
    adapter: str | None
    text: str
    num_tokens: int = Field(description="Tokens under the base model's tokenizer.")
    created_at: datetime
    cached_blocks: int = Field(0, description="KV blocks the engine holds for it (both request "
                               "forms: completions and chat); 0 until its KV is computed.")
    num_requests_using: int = Field(0, description="Running requests that read its KV now.")

    @classmethod
    def of(cls, record: SystemPromptRecord, num_tokens: int, cached_blocks: int = 0,
           num_requests_using: int = 0) -> SystemPrompt:
        return cls(tenant=record.tenant, name=record.name, adapter=record.adapter, text=record.text,
                   num_tokens=num_tokens, created_at=record.created_at, cached_blocks=cached_blocks,
                   num_requests_using=num_requests_using)


# Documents -------------------------------------------------------------------------------------
class DocumentCreate(Body):
    tenant: Name
    name: Name
    text: str = Field(min_length=1, max_length=200_000, pattern=r"^[^\x00]*$",
                      description="The document (UTF-8 text, no NUL characters).")


class Document(BaseModel):
    tenant: str
    name: str
    text: str
    num_chars: int
    num_tokens: int = Field(description="Tokens under the base model's tokenizer.")
    created_at: datetime

    @classmethod
    def of(cls, record: DocumentRecord, num_tokens: int) -> Document:
        return cls(tenant=record.tenant, name=record.name, text=record.text, num_chars=len(record.text),
                   num_tokens=num_tokens, created_at=record.created_at)


# Usage -----------------------------------------------------------------------------------------
class UsageRow(BaseModel):
    tenant: str
    adapter: str | None = Field(description="null for the base model.")
    hour: datetime = Field(description="Start of the UTC hour.")
    num_requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, record: UsageRecord) -> UsageRow:
        return cls(tenant=record.tenant, adapter=record.adapter, hour=record.hour,
                   num_requests=record.num_requests, prompt_tokens=record.prompt_tokens,
                   completion_tokens=record.completion_tokens,
                   total_tokens=record.prompt_tokens + record.completion_tokens)


class UsageTotals(BaseModel):
    num_requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageReport(BaseModel):
    since: datetime | None
    until: datetime | None
    rows: list[UsageRow]
    totals: UsageTotals


# Engine ----------------------------------------------------------------------------------------
class ResidentAdapter(BaseModel):
    digest: str = Field(description=f"The adapter's identity. {IDENTITY}")
    names: list[str] = Field(description="`tenant/name` of every adapter in the registry with this "
                             "digest now (several names can share one copy; none if all were deleted).")
    device_bytes: int = Field(0, description="Device memory it takes (its slot's pages of the pool).")


class PrefixCacheReset(BaseModel):
    dropped_blocks: int = Field(description="Cached prompt blocks that no request held, now free.")


class AdapterWait(BaseModel):
    num_requests: int = Field(description="Ended requests that had an adapter.")
    total_seconds: float = Field(description="Their waits for it, summed.")
    buckets: dict[str, int] = Field(description="Requests by upper bound of their wait, in seconds "
                                    '(not cumulative; "+Inf" last).')


class EngineSide(BaseModel):
    """One side of disaggregated prefill and decode."""

    num_requests_running: int
    num_requests_waiting: int = Field(description="On the decode side, the prefilled requests whose "
                                      "KV it has not received yet among them.")
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int


class KvTransfers(BaseModel):
    """KV sent from the prefill side to the decode side since start."""

    num_transfers: int = Field(description="Copies of a request's prompt blocks, or of a pinned prompt's.")
    num_blocks: int
    num_bytes: int
    seconds: float = Field(description="The transfers' times, summed.")
    bytes_per_second: float = Field(description="Bytes over seconds (0 before any transfer).")


class TenantRequests(BaseModel):
    running: int
    waiting: int = Field(description="Waiting requests, the swapped ones included.")
    swapped: int = Field(description="Waiting requests whose KV is in the host pool.")
    weight: float
    service: float = Field(description="The tenant's virtual token counter: prompt tokens + 2 x "
                           "generated tokens, over its weight (with the vtc policy).")


class EngineState(BaseModel):
    model: str
    device: str
    dtype: str
    max_model_len: int
    vocab_size: int
    shape: dict[str, int]
    """The base model's shape (layers, hidden and MLP sizes, heads, head size): what an
    adapter must fit."""
    is_alive: bool
    num_requests_running: int
    num_requests_waiting: int
    num_requests_in_flight: int = Field(description="Admitted by the server and not finished.")
    requests_by_tenant: dict[str, TenantRequests] = Field(
        description="Requests running, waiting and swapped in the engine, weight and service, per "
        "tenant that has requests or service.")
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cache_usage: float
    num_preemptions: int
    preemptions: dict[str, int] = Field(description='By "cause:mode": cause kv (blocks ran short), '
                                        "fairness or asked; mode swap or recompute.")
    host_pool_blocks: int = Field(description="KV blocks the host pool (swap_space) holds.")
    host_pool_blocks_used: int
    swap_bytes_out: int
    swap_bytes_in: int
    swap_seconds_out: float
    swap_seconds_in: float
    swap_seconds_stalled: float = Field(description="Time steps waited for swap copies (device idle).")
    prefix_cache_queries: int = Field(description="Prompt tokens looked up in the prefix cache.")
    prefix_cache_hits: int = Field(description="Prompt tokens found there (not computed again).")
    prefix_cache_evicted_blocks: int
    kv_blocks_shared: int = Field(description="KV blocks held by more than one request or pin.")
    relay_steps: int = Field(description="Decode steps that read shared prefixes once per group.")
    relay_groups: int = Field(description="Relay groups, summed over relay steps.")
    relay_members: int = Field(description="Requests in relay groups, summed over relay steps.")
    num_adapter_slots: int = Field(description="Adapter slots the pool has room for (the most "
                                   "resident at once, max_loras when set).")
    max_loras: int | None = Field(None, description="The cap on resident adapters, when set.")
    pool_page_bytes: int = Field(0, description="Bytes of a page of the device pool (a KV block).")
    pool_pages: dict[str, int] = Field(default_factory=dict, description='The device pool\'s pages by '
                                       'kind: "kv" (held), "adapters" (lent to adapter slots, slot 0\'s '
                                       'included), "free" (cached KV nobody holds among them).')
    num_adapter_evictions: int = Field(0, description="Adapters evicted from the device so far.")
    adapter_wait: AdapterWait | None = Field(None, description="Ended requests' waits for their adapter.")
    adapters_resident: list[ResidentAdapter] = Field(description="Adapters in device slots.")
    num_adapters_on_host: int = Field(description="Adapters in the engine's host tier.")
    host_tier_bytes: int
    max_host_tier_bytes: int
    num_adapter_host_loads: int = Field(description="Adapters read into the host tier so far.")
    num_adapter_slot_loads: int = Field(description="Adapters copied into device slots so far.")
    generation_tokens_per_second: float
    num_generated_tokens: int
    options: dict[str, Any] = Field(description="The engine's options, as `loraplex serve` flags "
                                    "(or their defaults) set them.")
    memory: dict[str, int | None] = Field(description="The engine's memory plan: the pool's pages and "
                                          "their size, adapter slots and their pages, the KV cache's "
                                          "cap, what was set aside for activations and graphs.")
    cuda_graphs: dict[str, Any] | None = Field(description="The decode graphs captured at start-up "
                                               "(none on CPU or with enforce_eager).")
    uptime_s: float
    sides: dict[str, EngineSide] | None = Field(
        None, description='Disaggregated serving (`--disaggregate`): "prefill" and "decode", each '
        "side's queue and KV pool (the figures above are both sides' together); null otherwise.")
    kv_transfers: KvTransfers | None = Field(None, description="Disaggregated serving: the KV sent "
                                             "between the sides; null otherwise.")


# Audit and identity ----------------------------------------------------------------------------
class AuditEntry(BaseModel):
    id: int
    actor_key_id: int | None
    action: str
    object_type: str
    object_id: str
    details: dict
    created_at: datetime

    @classmethod
    def of(cls, record: AuditRecord) -> AuditEntry:
        return cls(id=record.id, actor_key_id=record.actor_key_id, action=record.action,
                   object_type=record.object_type, object_id=record.object_id,
                   details=record.details, created_at=record.created_at)


class Me(BaseModel):
    key_id: int
    role: Literal["admin", "tenant"]
    tenant: str | None
