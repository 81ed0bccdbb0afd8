"""The engine's tenant weights, kept in step with the registry's: every tenant's at start-up,
a tenant's own when an admin changes it here, and at each request when the tenant's record (a
cached read, refreshed within the registry cache's time to live) shows another weight, which
is how a change made through another replica arrives."""

from __future__ import annotations

from operator import methodcaller

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.core_client import EngineCoreClient
from loraplex.engine.tenants import MAX_WEIGHT, MIN_WEIGHT
from loraplex.registry.records import TenantRecord


class TenantWeights:
    def __init__(self, engine: AsyncEngine | EngineCoreClient) -> None:
        self._engine = engine
        self._sent: dict[str, float] = {}

    def sync(self, tenant: TenantRecord) -> None:
        """Pass the tenant's weight to the engine if it is not the one last passed (it applies
        from the engine's next step)."""
        # A weight stored before the range was enforced is taken at the range's nearest end.
        name, weight = tenant.name, min(max(tenant.weight, MIN_WEIGHT), MAX_WEIGHT)
        if self._sent.get(name) != weight:
            self._sent[name] = weight
            self._engine.submit(methodcaller("set_tenant_weight", name, weight))
