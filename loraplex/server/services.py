"""The per-app services that routes reach through dependencies: created when the app's
lifespan starts (the engine thread starts with them) and stopped when it ends."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.core_client import EngineCoreClient, EngineView
from loraplex.engine.llm_engine import LLMEngine
from loraplex.registry import Registry
from loraplex.server.adapter_names import AdapterNames
from loraplex.server.codec import TextCodec
from loraplex.server.found_documents import DocumentIndex
from loraplex.server.limits import WINDOW_S, Limiter
from loraplex.server.metrics import Metrics
from loraplex.server.monitor import EngineMonitor
from loraplex.server.principals import Principals
from loraplex.server.server_config import ServerConfig
from loraplex.server.shared_limits import SharedLimits
from loraplex.server.structured_outputs import GrammarPool
from loraplex.server.tenant_weights import TenantWeights
from loraplex.server.usage_recorder import UsageRecorder


@dataclass
class Services:
    config: ServerConfig
    registry: Registry
    llm: LLMEngine | EngineView
    """The engine itself (or, with the engine in a process of its own, its view): only its fixed
    facts (tokenizer, context length, model config) are read here; everything else goes through
    `engine`, on the engine thread or in the engine-core process."""
    engine: AsyncEngine | EngineCoreClient
    principals: Principals
    codec: TextCodec
    adapters: AdapterNames
    limiter: Limiter
    usage: UsageRecorder
    monitor: EngineMonitor
    metrics: Metrics
    upload_slots: asyncio.Semaphore
    tenant_weights: TenantWeights
    grammars: GrammarPool
    """Compiles requests' output constraints off the event loop and the engine thread."""
    documents: DocumentIndex
    """Tenants' registered documents, to find in prompts that do not name them."""
    started_at: float = field(default_factory=time.time)
    is_stopping: bool = False
    is_draining: bool = False
    """Set on SIGTERM: readiness fails and new generation requests get 503; those admitted run
    to their end."""

    @classmethod
    def start(cls, config: ServerConfig, registry: Registry, llm: LLMEngine | EngineCoreClient,
              adapters: AdapterNames | None = None) -> Services:
        """Start the engine thread (or drive the engine-core process `llm`) and the background
        work; call from the event loop. `adapters` replaces the registry's adapter names and
        blobs (a benchmark's synthetic adapters; loraplex.benchmarks.synthetic_server)."""
        core = llm if isinstance(llm, EngineCoreClient) else None
        if core is not None:
            llm = core.view
        adapters = adapters or AdapterNames(registry, llm.model_config.shape, llm.config.lora.max_lora_rank,
                                            config.registry_cache_ttl_s, config.registry_max_stale_s)
        if core is None:
            llm.set_adapter_loader(adapters.load)
        else:  # the core reads each adapter itself, where `locate` says
            core.set_adapter_locator(adapters.locate)
        engine = core or AsyncEngine(llm)
        monitor = EngineMonitor(engine, config.engine_poll_interval_s)
        shared = None if registry.db.is_sqlite else SharedLimits(
            registry.rate_windows.exchange, config.limits_sync_interval_s, WINDOW_S)
        limiter = Limiter(config.max_requests_in_flight, config.retry_after_s, shared=shared)
        codec = TextCodec(llm.tokenizer, max_prompt_tokens(config, llm), config.tokenizer_threads)
        services = cls(
            config=config, registry=registry, llm=llm, engine=engine,
            principals=Principals(registry, config.registry_cache_ttl_s, config.registry_max_stale_s),
            codec=codec,
            adapters=adapters,
            limiter=limiter, usage=UsageRecorder(registry), monitor=monitor,
            metrics=Metrics(config.model_id, monitor, lambda: limiter.num_in_flight, adapters.names_of,
                            engine_pid=None if core is None else core.pid),
            upload_slots=asyncio.Semaphore(config.max_concurrent_uploads),
            tenant_weights=TenantWeights(engine),
            grammars=GrammarPool(lambda: llm.grammars, config.grammar_threads, config.max_grammar_compile_s),
            documents=DocumentIndex(registry, codec, config.min_found_document_tokens,
                                    config.registry_cache_ttl_s, config.registry_max_stale_s),
        )
        for tenant in registry.tenants.list():
            services.tenant_weights.sync(tenant)
        monitor.start()
        if shared is not None:
            shared.start()
        return services

    def begin_drain(self) -> None:
        self.is_draining = True

    @property
    def max_prompt_tokens(self) -> int:
        return max_prompt_tokens(self.config, self.llm)

    async def stop(self) -> None:
        self.is_stopping = True
        await self.monitor.stop()
        if self.limiter.shared is not None:
            await self.limiter.shared.stop()
        await run_in_threadpool(self.usage.close)
        await run_in_threadpool(self.engine.shutdown)
        self.codec.close()
        self.grammars.close()


STREAMING_PROMPT_CONTEXTS = 8
"""With the engine's attention sinks on (`--sliding-window`), the longest prompt accepted by
default, in contexts."""


def max_prompt_tokens(config: ServerConfig, llm: LLMEngine | EngineView) -> int:
    """The longest prompt accepted: the context less one token, or the configured limit. With
    the engine's attention sinks on, prompts may run past the context: the configured limit, by
    default STREAMING_PROMPT_CONTEXTS contexts."""
    if llm.streaming_window is not None:
        return config.max_prompt_tokens or STREAMING_PROMPT_CONTEXTS * llm.max_model_len
    context = llm.max_model_len - 1
    return context if config.max_prompt_tokens is None else min(config.max_prompt_tokens, context)
