"""The engine's tenant table: each tenant's scheduling weight, changeable while the engine runs.
Requests name their tenant; one that names none belongs to DEFAULT_TENANT. The scheduling policy
reads the weights at every step, so a change applies to the next one. Pure Python."""

from __future__ import annotations

import math

from loraplex.errors import InvalidRequestError

DEFAULT_TENANT = "default"
"""The tenant of requests that name none (the offline API's, unless it says otherwise)."""
DEFAULT_WEIGHT = 1.0


class TenantTable:
    def __init__(self) -> None:
        self._weights: dict[str, float] = {}

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, DEFAULT_WEIGHT)

    def set_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share under contention, relative to the others' (default 1)."""
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise InvalidRequestError(f"a tenant's weight must be a finite number > 0, not {weight!r}",
                                      param="weight")
        self._weights[tenant] = float(weight)

    @property
    def weights(self) -> dict[str, float]:
        """Every tenant whose weight was set, with its weight."""
        return dict(self._weights)
