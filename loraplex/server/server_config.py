"""Server settings: one frozen object built at the edge (`loraplex serve`, tests) and passed to
`create_app`. Engine and registry settings live in their own configs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    """The base model's id in the API: `model` names it (or one of the caller's adapters), and
    /v1/models lists it first."""
    max_body_bytes: int = 4 << 20
    """Largest JSON request body (413 past it)."""
    max_upload_bytes: int = (1 << 30) + (1 << 20)
    """Largest adapter upload body (multipart: config, weights and form fields)."""
    max_tokens_limit: int | None = None
    """Most tokens one request may ask to generate (`max_tokens`); None: only the context left
    after the prompt bounds it."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted; None means the model's context minus one token."""
    max_requests_in_flight: int = 512
    """Requests admitted and not finished, across tenants (running + waiting in the engine):
    past it new requests get 503 with Retry-After."""
    registry_cache_ttl_s: float = 1.0
    """How long API keys, tenant limits and adapter records read from the registry are reused.
    Changes made through this server's admin API apply at once; those made by other processes
    (the CLI, other replicas) within this time."""
    registry_max_stale_s: float = 600.0
    """While the registry database is unavailable (stopped, restarting, locked), keys, tenant
    limits and adapter records read before are reused up to this long past their time, so their
    tenants keep being served; requests that need anything else get 503 with Retry-After. A
    read slower than 0.25 s is not waited for either when such a value exists; one that then
    answers that the key was revoked (or the adapter deleted) drops the value at once."""
    limits_sync_interval_s: float = 0.25
    """With a PostgreSQL registry (several replicas), how often this replica sends what it
    admitted to the registry and reads the others' counts: tenant limits hold across replicas
    up to what the others admit in about two of these intervals. Unused on SQLite."""
    tokenizer_threads: int = 2
    """Threads that tokenize prompts, each with its own copy of the tokenizer. A tenant uses
    one at a time (with one thread: that one, in turn with the others)."""
    max_concurrent_uploads: int = 4
    """Adapter uploads validated at once; more wait for a turn."""
    max_connections: int = 4096
    """Open client connections; past it a new connection's request gets 503 with Retry-After
    (`loraplex serve` raises its file limit to fit, or lowers this to what the limit allows)."""
    client_timeout_s: float = 15.0
    """The longest a client may take to send a request's headers, to start sending its body at
    `min_body_bytes_per_s`, or to leave its response unread (a stalled write); past it the
    connection is closed (408 where nothing was answered yet; a generation is aborted)."""
    min_body_bytes_per_s: int = 1024
    """The slowest a request body may arrive, on average, once `client_timeout_s` has passed."""
    retry_after_s: int = 1
    """Retry-After sent with 503s when the server is full or not ready."""
    engine_poll_interval_s: float = 1.0
    """How often engine state (running, waiting, KV use, tokens/s) is sampled for /metrics and
    the admin API."""
    grammar_threads: int = 2
    """Threads that compile structured-output constraints (JSON schemas, regexes, grammars)."""
    max_grammar_compile_s: float = 10.0
    """A constraint that takes longer to compile is refused (400; its compile finishes in the
    background and is cached)."""
    min_found_document_tokens: int = 64
    """Registered documents of at least this many tokens are looked for in prompts that do not
    name them, and blended where found whole (loraplex/server/found_documents.py); 0: never.
    A document shorter than a few KV blocks has little KV to reuse."""
    admin_ui_dir: Path | None = None
    """Folder served at /admin when it holds an index.html (the admin web UI)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_upload_bytes", "max_requests_in_flight",
                     "max_concurrent_uploads", "retry_after_s", "tokenizer_threads",
                     "grammar_threads", "max_connections", "min_body_bytes_per_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.min_found_document_tokens < 0:
            raise ValueError("min_found_document_tokens must be >= 0")
        for name in ("max_tokens_limit", "max_prompt_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.registry_cache_ttl_s < 0 or self.engine_poll_interval_s <= 0:
            raise ValueError("registry_cache_ttl_s must be >= 0 and engine_poll_interval_s > 0")
        if self.client_timeout_s <= 0:
            raise ValueError("client_timeout_s must be positive")
        if self.max_grammar_compile_s <= 0:
            raise ValueError("max_grammar_compile_s must be positive")
        if self.registry_max_stale_s < 0:
            raise ValueError("registry_max_stale_s must be >= 0")
        if self.limits_sync_interval_s <= 0:
            raise ValueError("limits_sync_interval_s must be positive")
        if not self.model_id:
            raise ValueError("model_id must not be empty")
